"""Step commit, failover and admission: the coordinator's part of docs/design.md invariants 2 and 3.

Each rank votes on its step's rounds at its own coordinator (``CommitStep``); once all
have, the site votes at the *leader*, the lowest-index member it has not lost touch with
(``SiteVote``: one WAN call per site per step). The leader alone decides, per (step,
generation):

* COMMIT when every member voted ok: each site applies the update (invariant 2: once or
  not at all). A COMMIT may carry the next generation, admitting waiting sites; the
  leader's ranks then offer their state after the step, and the joiners pull it.
* RETRY when a member voted not ok or fell silent for ``failure_timeout_s``: the leader
  proposes generation g+1 with the members still heard from (``Propose``), and every
  member runs the step's rounds again in it.
* STOP when no quorum can be formed for ``quorum_wait_s``.

Quorum: more than half of the job's sites, or exactly half including the first site
(a 2-site job split in two goes on on one side only). If the leader falls silent, the
next member in index order proposes g+1 and asks every member which steps it committed,
so a COMMIT the old leader handed out before dying is honoured.

A site that learns from a heartbeat that the job moved on without it joins again and is
admitted like a restarted site: its ranks get REJOIN and pull the state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext

import grpc

from isthmus.inter.bounds import RefusalLog, WaitSlots
from isthmus.inter.control.admission import malformed_proposal, unconfirmed_proposal
from isthmus.inter.control.ballots import Ballots
from isthmus.inter.control.leader import Leader, has_quorum
from isthmus.inter.control.rank_keys import RankKeys
from isthmus.inter.control.rank_liveness import CHECK_S, RankLiveness
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.control.state import Adoption, CoordinatorState, Key
from isthmus.inter.control.witness import WitnessLink
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["Failover", "has_quorum"]

log = logging.getLogger(__name__)

_LOOP_S = 0.05  # how often pending votes are forwarded and re-evaluated
_FORWARD_WAIT_MS = 500  # long poll of one SiteVote
MAX_STEP = 1 << 40  # steps beyond this are refused as nonsense
MAX_HOST_BALLOTS = 256  # ranks one CommitHostStep speaks for (a host has 8 or so)


def _pending(step: int, reason: str = "") -> pb.Decision:
    return pb.Decision(step=step, verdict=pb.VERDICT_PENDING, reason=reason)


def _check_range(request, context: grpc.ServicerContext) -> None:
    if request.step > MAX_STEP or request.generation == 0:
        why = f"step {request.step} / generation {request.generation} out of range"
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)


class Failover:
    """The voting and membership-change logic of one site's coordinator: the membership
    lives in ``state``, the votes and decisions in :attr:`ballots`, the leader's decisions
    in :attr:`leader`. ``stubs`` is filled once the site starts."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        state: CoordinatorState,
        *,
        stubs: Mapping[str, pb_grpc.CoordinatorStub],
        rank_keys: RankKeys,
        refusals: RefusalLog,
        long_polls: WaitSlots,
        witness: WitnessLink | None,
        rank_liveness: RankLiveness,
    ) -> None:
        self.settings, self.state, self.stubs = settings, state, stubs
        self._rank_keys, self._refusals, self._long_polls = rank_keys, refusals, long_polls
        self.ballots = Ballots(state)
        self.rank_liveness = rank_liveness
        s = settings
        self.leader = Leader(
            state=state,
            ballots=self.ballots,
            peer_stub=stubs.__getitem__,
            witness=witness,
            rpc_timeout_s=s.rpc_timeout_s,
            min_sites=s.min_sites,
            quorum_wait_s=s.quorum_wait_s,
        )
        self._suspects: list[str] = []  # as the loop last saw them (it wakes waiters on a change)
        self._ranks_checked = float("-inf")  # when the ranks' silence was last checked
        self._thread = threading.Thread(
            target=self._run, name=f"failover-{settings.site}", daemon=True
        )

    def _leader_locked(self, exclude: Iterable[str] = ()) -> str:
        gone = set(self.state.suspects_locked()) | set(exclude)
        alive = [m for m in self.state.members if m not in gone]
        return alive[0] if alive else self.state.site

    def _refuse_if_too_far_locked(self, step: int, context: grpc.ServicerContext) -> None:
        st, window = self.state, self.settings.vote_window
        runs = max(st.committed_steps, st.start_step, self.settings.first_step)
        if step > runs + window:
            far = f"a vote for step {step}, more than {window} steps past step {runs}"
            self._refusals.note(context.peer(), far)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.settings.where}: {far}")

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def commit_step(self, request: pb.CommitStepRequest, context: grpc.ServicerContext):
        """A local rank's vote; long poll for the decision on (step, generation)."""
        ballot = pb.RankBallot(rank=request.rank, ok=request.ok, rank_key=request.rank_key)
        key = self._record_votes(request, [ballot], context)
        # The vote proved its rank's key: its polls are never paced.
        rank = f"{self.settings.site} rank {request.rank}"
        return self._await(key, request.wait_ms, context, rank, sites_known=request.sites_known)

    def commit_host_step(
        self,
        request: pb.CommitHostStepRequest,
        context: grpc.ServicerContext,
        *,
        in_session: bool = False,
    ):
        """The votes of several ranks of one host; one long poll for their decision
        (``in_session``: a HostSession's, whose slot bounds its waits already)."""
        ranks = [b.rank for b in request.ballots]
        if not 1 <= len(ranks) <= MAX_HOST_BALLOTS or len(set(ranks)) != len(ranks):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a host votes for 1 to {MAX_HOST_BALLOTS} distinct ranks, got "
                f"{len(ranks)} ballots for {len(set(ranks))} ranks",
            )
        key = self._record_votes(request, request.ballots, context)
        host = f"{self.settings.site} host of rank {min(ranks)}"
        known, slot = request.sites_known, not in_session
        return self._await(key, request.wait_ms, context, host, sites_known=known, slot=slot)

    def _record_votes(
        self,
        request: pb.CommitStepRequest | pb.CommitHostStepRequest,
        ballots: Sequence[pb.RankBallot],
        context: grpc.ServicerContext,
    ) -> Key:
        """Records all the ballots, each with its rank's key, or refuses the call with none."""
        s, invalid = self.settings, grpc.StatusCode.INVALID_ARGUMENT
        if request.site != s.site:
            why = f"vote for site {request.site[:64]!r} sent to the coordinator of {s.site}"
            context.abort(invalid, why)
        for ballot in ballots:
            if ballot.rank >= s.ranks:
                context.abort(
                    invalid, f"rank {ballot.rank} is not one of {s.site}'s {s.ranks} ranks"
                )
        _check_range(request, context)
        for ballot in ballots:
            if not self._rank_keys.is_rank(ballot.rank, ballot.rank_key):
                why = f"a vote for rank {ballot.rank} without the key it registered with"
                self._refusals.note(context.peer(), why)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{s.where}: {why}")
        key = (request.step, request.generation)
        st = self.state
        with st.cond:
            if request.generation > st.generation:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"generation {request.generation} is ahead of {s.site}'s {st.generation}",
                )
            self._refuse_if_too_far_locked(request.step, context)
            for ballot in ballots:
                self.ballots.vote_rank_locked(key, ballot.rank, ballot.ok)
        # A vote is a beat: a late agent's ranks that still vote through it are not silent.
        self.rank_liveness.voted([ballot.rank for ballot in ballots])
        return key

    def site_vote(self, request: pb.SiteVoteRequest, context: grpc.ServicerContext):
        """A member site's vote at this (leader) site; long poll for the decision."""
        s = self.settings
        if request.site not in s.peers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {request.site[:64]!r}")
        _check_range(request, context)
        unknown = [n[:64] for n in request.suspects if n not in s.site_names]
        if unknown:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"suspects name unknown sites {unknown[:4]}"
            )
        key = (request.step, request.generation)
        st, b = self.state, self.ballots
        with st.cond:
            st.heard_from_locked(request.site)
            if request.site not in st.members:
                # Before the stored decisions: one of an older generation may name the
                # voter and send it back. It hears it was left out from its heartbeats.
                why = f"{request.site} is not a member of generation {st.generation}"
                return _pending(request.step, why)
            found = b.decisions.get(key)
            if found is not None:
                return found
            if request.generation < st.generation:
                # The voter ran the step in a generation this site has left: run it again
                # in the current one, unless the current one already decided the step.
                if (request.step, st.generation) in b.decisions:
                    return b.decisions[(request.step, st.generation)]
                return b.retry_locked(request.step, "generation moved on")
            if request.generation > st.generation or self._leader_locked() != s.site:
                why = f"{s.site} is not the leader of generation {request.generation}"
                return _pending(request.step, why)
            self._refuse_if_too_far_locked(request.step, context)
            # A "not ok" stands once cast (Ballots.vote_site_locked says why).
            b.vote_site_locked(key, request.site, request.ok, request.suspects)
        self.leader.evaluate(key)
        return self._await(key, request.wait_ms, context, f"{request.site}'s vote", paced=True)

    def propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext):
        s, st = self.settings, self.state
        problem = malformed_proposal(s, request, MAX_STEP)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.generation > st.generation and (
            why := unconfirmed_proposal(s, st, self.stubs[request.leader], request)
        ):
            self._refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{s.where}: {why}")
        with st.cond:
            st.heard_from_locked(request.leader)
            adopted = self.ballots.adopt_locked(request)
            return pb.ProposeResponse(
                accepted=adopted is not Adoption.STALE,
                generation=st.generation,
                committed_steps=st.committed_steps,
            )

    def _await(
        self,
        key: Key,
        wait_ms: int,
        context: grpc.ServicerContext,
        caller: str,
        *,
        paced: bool = False,
        sites_known: bool = False,
        slot: bool = True,
    ) -> pb.Decision:
        # ``caller`` holds two slots at most (a vote, an early vote), a HostSession's vote its
        # session's. Each waits on its key's event: waking all per transition grew with ranks.
        st, b = self.state, self.ballots
        waits = (
            self._long_polls.wait(context, caller, 2, paced=paced) if slot else nullcontext(True)
        )
        with waits as may_wait:
            deadline = st.clock() + (min(wait_ms, 30_000) / 1000.0 if may_wait else 0.0)
            while True:
                with st.cond:
                    # A vote older than this site's readmission pulls the state, whatever
                    # else was decided for its key (a RETRY would rerun a step left behind).
                    rejoin = b.readmitted_locked(key)
                    if rejoin is not None:
                        return rejoin
                    left = self._left_locked(key)
                    if left is not None:
                        return left
                    found = b.answer_locked(key, sites_known)
                    if found is not None:
                        return found
                    remaining = deadline - st.clock()
                    if remaining <= 0 or st.stopped.is_set():
                        return _pending(key[0])
                    decided = b.decision_event_locked(key)
                decided.wait(remaining)

    def _run(self) -> None:
        st, b = self.state, self.ballots
        settled: set[Key] = set()  # keys settled at least once (a new one goes at once)
        while not st.stopped.is_set():
            with st.cond:
                # Woken by a site's last vote (or other news), else every _LOOP_S. A key
                # completed while settling another is not waited for (up to 50 ms a step).
                fresh = st.generation and set(b.voted_locked(st.ranks)) - settled
                if not fresh:
                    st.cond.wait(_LOOP_S)
                if st.generation == 0:
                    continue
                suspects = st.suspects_locked()
                if suspects != self._suspects:  # silence is noticed by time, not by a call
                    self._suspects = suspects
                    st.membership_news.publish()  # wake ranks long-polling GetMembership
                    st.cond.notify_all()
                ready = b.voted_locked(st.ranks)
            self._watch_ranks()
            settled = set(ready)
            for key in ready:
                try:
                    self.settle(key)
                except Exception:  # never let the loop die; the next pass tries again
                    log.exception("[%s] settling step %d failed", st.site, key[0])

    def _watch_ranks(self) -> None:
        """A rank of this site fell silent while it runs: the site leaves the job, so its
        peers go on without it instead of waiting for the rank's vote until sync.timeout_s."""
        st, live = self.state, self.rank_liveness
        now = st.clock()
        if now - self._ranks_checked < CHECK_S:
            return
        self._ranks_checked = now
        silent = live.silent()
        if not silent:
            return
        with st.cond:
            if not st.running or st.finished or st.stopped.is_set():
                return
            ranks = ", ".join(map(str, silent))
            live.left_for = f"rank {ranks} of {st.site} silent for over {live.silence_s:g}s"
            live.forget()
            st.lose_ranks_locked(live.left_for)

    def _left_locked(self, key: Key) -> pb.Decision | None:
        """STOP for a vote of a rank that outlived the site's dead rank while the site is
        out (its process group died with it; every rank must start anew). A key every
        rank voted on went to the leader already and waits for its decision."""
        why, b = self.rank_liveness.left_for, self.ballots
        if why is None or key in b.decisions or len(b.rank_votes.get(key, ())) >= self.state.ranks:
            return None
        return pb.Decision(
            step=key[0],
            verdict=pb.VERDICT_STOP,
            generation=key[1],
            reason=f"{why}: {self.settings.site} left the job; start its ranks again to rejoin",
        )

    def settle(self, key: Key) -> None:
        st, b = self.state, self.ballots
        with st.cond:
            if key[1] != st.generation:
                # Votes of a generation this site left run again, unless the site was
                # admitted back since (_await hands them the REJOIN).
                readmitted = b.readmitted_locked(key) is not None
                if key not in b.decisions and st.site in st.members and not readmitted:
                    b.decide_locked(key, b.retry_locked(key[0], "generation moved on"))
                return
            leader = self._leader_locked()
            votes = b.rank_votes[key]
            ok = all(votes.values())
            suspects = st.suspects_locked()
        if leader == st.site:
            self.leader.evaluate(key)
            return
        with st.cond:
            # A suspect leader is silent: the next member in line (maybe this one) leads.
            if leader in suspects:
                leader = self._leader_locked()
        request = pb.SiteVoteRequest(
            site=st.site,
            step=key[0],
            generation=key[1],
            ok=ok,
            wait_ms=_FORWARD_WAIT_MS,
            suspects=suspects,
        )
        try:
            decision = self.stubs[leader].SiteVote(
                request, timeout=self.settings.rpc_timeout_s + _FORWARD_WAIT_MS / 1000
            )
        except grpc.RpcError as exc:
            log.debug("[%s] vote at %s: %s", st.site, leader, exc.code().name)
            with st.cond:
                silent = leader in st.suspects_locked()
                nxt = self._leader_locked(exclude=[leader]) if silent else None
            if nxt == st.site:
                self.leader.takeover(key, leader)
            return
        if decision.verdict == pb.VERDICT_PENDING:
            return
        going_on = decision.verdict in (pb.VERDICT_COMMIT, pb.VERDICT_RETRY)
        if going_on and st.site not in [info.name for info in decision.sites]:
            # The job went on without this site: ask to be admitted again (REJOIN then).
            with st.cond:
                st.exclude_locked(f"step {key[0]} went on without this site")
            return
        with st.cond:
            if going_on and decision.generation > st.generation:
                # The Propose may still be on its way; the decision carries the same news.
                news = pb.ProposeRequest(leader=leader, generation=decision.generation)
                news.start_step = key[0] + 1 if decision.verdict == pb.VERDICT_COMMIT else key[0]
                news.state_source = decision.state_source
                news.sites.extend(decision.sites)
                b.adopt_locked(news)
            if key not in b.decisions:
                b.decide_locked(key, decision)
