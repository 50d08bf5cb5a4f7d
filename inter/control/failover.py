"""Step commit, failover and admission: the coordinator's part of docs/design.md invariants 2 and 3.

Every step, each rank votes on its cross-site rounds at its own coordinator
(``CommitStep``, site-local). Once every local rank has voted, the site votes at the
*leader* -- the lowest-index member it has not lost touch with -- with ``SiteVote``
(one WAN call per site per step). The leader alone decides, per (step, generation):

* COMMIT when every member voted ok: each site applies the update (invariant 2: an
  update is applied once or not at all). A COMMIT may carry the next generation when
  restarted or excluded sites are waiting to be admitted; the leader's ranks then
  offer their state after the step, and the joiners pull it.
* RETRY when a member voted not ok or fell silent for ``failure_timeout_s``: the
  leader proposes generation g+1 with the members still heard from (``Propose``) and
  every member runs the step's rounds again in it, untouched shards and all.
* STOP when no quorum can be formed for ``quorum_wait_s``.

Quorum: more than half of the job's sites, or exactly half including the job's first
site (so a 2-site job split in two goes on on one side only). If the leader itself
falls silent, the next member in index order takes over: it proposes g+1 and asks
every member which steps it committed, so a COMMIT the old leader handed out before
dying is honoured rather than contradicted.

A site that learns from a heartbeat that the job moved on without it (a partition
healed after the other side went on) joins again and is admitted like a restarted
site: its ranks get REJOIN and pull the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.control.admission import malformed_proposal, unconfirmed_proposal
from isthmus.inter.control.leader import Leader, has_quorum
from isthmus.proto import coordinator_pb2 as pb

if TYPE_CHECKING:
    from isthmus.inter.control.coordinator import Coordinator

__all__ = ["Failover", "has_quorum"]

log = logging.getLogger(__name__)

_LOOP_S = 0.05  # how often pending votes are forwarded and re-evaluated
_FORWARD_WAIT_MS = 500  # long poll of one SiteVote
MAX_STEP = 1 << 40  # steps beyond this are refused as nonsense


def _verdict_name(verdict: int) -> str:
    return pb.Verdict.Name(verdict).removeprefix("VERDICT_")


class Failover(Leader):
    """The voting and membership-change logic of one site's coordinator.

    Args:
        coordinator: the site's coordinator; its condition variable guards this
            object's state too.
        failure_timeout_s: a member not heard from for this long is suspected dead.
        min_sites: never go on with fewer live sites.
        quorum_wait_s: how long a site without quorum waits before it stops.
        vote_window: votes for steps more than this past the step the site runs are
            refused (forged votes for coming steps once froze a job: issue 14, row 3).
        first_step: the job's first step (a resumed job starts past 0).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        failure_timeout_s: float = 10.0,
        min_sites: int = 1,
        quorum_wait_s: float = 60.0,
        vote_window: int = 64,
        first_step: int = 0,
    ) -> None:
        if failure_timeout_s <= 0 or quorum_wait_s < 0 or min_sites < 1 or vote_window < 1:
            raise ValueError(
                "need failure_timeout_s > 0, quorum_wait_s >= 0, min_sites >= 1 and "
                f"vote_window >= 1, got {failure_timeout_s}, {quorum_wait_s}, {min_sites}, "
                f"{vote_window}"
            )
        self.c = coordinator
        self.failure_timeout_s = failure_timeout_s
        self.min_sites = min_sites
        self.quorum_wait_s = quorum_wait_s
        self.vote_window = vote_window
        self.first_step = first_step
        self.committed_steps = 0
        """Steps this site has committed: the next step it runs."""
        self._rank_votes: dict[tuple[int, int], dict[int, bool]] = {}
        self._site_votes: dict[tuple[int, int], dict[str, tuple[bool, frozenset[str]]]] = {}
        self._decisions: dict[tuple[int, int], pb.Decision] = {}
        self._joiners: dict[str, pb.SiteInfo] = {}
        self.restarted: set[str] = set()
        """Members seen joining afresh: their earlier incarnation is dead."""
        self._stuck_since: float | None = None
        self._deciding: set[tuple[int, int]] = set()
        self._rejoin_decision: pb.Decision | None = None
        # The highest generation any proposal answer named: a retried proposal goes
        # above it, so a site that accepted a failed attempt is not asked the same number.
        self._highest_generation = 0
        self.proposing: dict[int, list[str]] = {}
        """generation -> members, while this site proposes it (asked by the members)."""
        self._suspects: list[str] = []
        self._thread = threading.Thread(
            target=self._run, name=f"failover-{coordinator.site}", daemon=True
        )

    # -- views (call with the coordinator's condition held) ---------------------------

    def suspects_locked(self) -> list[str]:
        """Members other than this site not heard from within the failure timeout."""
        c = self.c
        now = time.monotonic()
        started = getattr(c, "_started_at", now)
        return [
            m
            for m in c.members
            if m != c.site
            and (m in self.restarted or now - c.last_seen.get(m, started) > self.failure_timeout_s)
        ]

    def _leader_locked(self, exclude: Iterable[str] = ()) -> str:
        gone = set(self.suspects_locked()) | set(exclude)
        alive = [m for m in self.c.members if m not in gone]
        return alive[0] if alive else self.c.site

    def _sites_of(self, names: Iterable[str]) -> list[pb.SiteInfo]:
        return self.c.infos_locked(names, extra=self._joiners)

    def _ordered(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names), key=self.c.site_names.index)

    def _refuse_if_too_far_locked(self, step: int, context: grpc.ServicerContext) -> None:
        """Refuses (and logs) a vote for a step too far past the one this site runs."""
        runs = max(self.committed_steps, self.c.start_step, self.first_step)
        if step > runs + self.vote_window:
            far = f"a vote for step {step}, more than {self.vote_window} steps past step {runs}"
            self.c.refusals.note(context.peer(), far)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.c.where}: {far}")

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- handlers ------------------------------------------------------------------------

    def commit_step(self, request: pb.CommitStepRequest, context: grpc.ServicerContext):
        """A local rank's vote; long poll for the decision on (step, generation)."""
        c = self.c
        if request.site != c.site:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"vote for site {request.site[:64]!r} sent to the coordinator of {c.site}",
            )
        if request.rank >= c.ranks:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {request.rank} is not one of {c.site}'s {c.ranks} ranks",
            )
        if request.step > MAX_STEP or request.generation == 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step {request.step} / generation {request.generation} out of range",
            )
        if not c.rank_keys.is_rank(request.rank, request.rank_key):
            why = f"a vote for rank {request.rank} without the key it registered with"
            c.refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{c.where}: {why}")
        key = (request.step, request.generation)
        with c._cond:
            if request.generation > c._generation:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"generation {request.generation} is ahead of {c.site}'s {c._generation}",
                )
            self._refuse_if_too_far_locked(request.step, context)
            votes = self._rank_votes.setdefault(key, {})
            votes[request.rank] = votes.get(request.rank, True) and request.ok
            c._cond.notify_all()
        return self._await(key, request.wait_ms, context)

    def site_vote(self, request: pb.SiteVoteRequest, context: grpc.ServicerContext):
        """A member site's vote at this (leader) site; long poll for the decision."""
        c = self.c
        if request.site not in c.peers:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {request.site[:64]!r}")
        if request.step > MAX_STEP or request.generation == 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step {request.step} / generation {request.generation} out of range",
            )
        unknown = [s[:64] for s in request.suspects if s not in c.site_names]
        if unknown:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"suspects name unknown sites {unknown[:4]}"
            )
        key = (request.step, request.generation)
        with c._cond:
            c.last_seen[request.site] = time.monotonic()
            if request.site not in c.members:
                # Checked before the stored decisions: one of an older generation may
                # name the voter and would send it back into a generation the job has
                # left. It hears that it was left out from its heartbeats, and joins.
                return pb.Decision(
                    step=request.step,
                    verdict=pb.VERDICT_PENDING,
                    reason=f"{request.site} is not a member of generation {c._generation}",
                )
            found = self._decisions.get(key)
            if found is not None:
                return found
            if request.generation < c._generation:
                # The voter ran the step in a generation this site has left: run it again
                # in the current one, unless the current one already decided the step.
                if (request.step, c._generation) in self._decisions:
                    return self._decisions[(request.step, c._generation)]
                return self._retry_locked(request.step, "generation moved on")
            if request.generation > c._generation or self._leader_locked() != c.site:
                return pb.Decision(
                    step=request.step,
                    verdict=pb.VERDICT_PENDING,
                    reason=f"{c.site} is not the leader of generation {request.generation}",
                )
            self._refuse_if_too_far_locked(request.step, context)
            # A site's vote is resent while it waits; a "not ok" stands once cast, so a
            # second call saying "ok" (a forged one) cannot turn a failed round into a
            # commit. The worst such a call can do is make the step run again.
            votes = self._site_votes.setdefault(key, {})
            ok = votes[request.site][0] and request.ok if request.site in votes else request.ok
            votes[request.site] = (ok, frozenset(request.suspects))
        self._evaluate(key)
        return self._await(key, request.wait_ms, context)

    def propose(self, request: pb.ProposeRequest, context: grpc.ServicerContext):
        """Adopt a higher generation proposed by its leader."""
        c = self.c
        problem = malformed_proposal(c, request, MAX_STEP)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if request.generation > c.generation and (why := unconfirmed_proposal(c, request)):
            c.refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{c.where}: {why}")
        with c._cond:
            c.last_seen[request.leader] = time.monotonic()
            accepted = request.generation > c._generation
            if accepted:
                self._adopt_locked(
                    request.generation,
                    list(request.sites),
                    request.start_step,
                    request.state_source,
                    request.leader,
                )
            return pb.ProposeResponse(
                accepted=accepted,
                generation=c._generation,
                committed_steps=self.committed_steps,
            )

    # -- shared steps ----------------------------------------------------------------------

    def _await(
        self, key: tuple[int, int], wait_ms: int, context: grpc.ServicerContext
    ) -> pb.Decision:
        c = self.c
        with c.long_polls.wait(context) as may_wait, c._cond:
            deadline = time.monotonic() + (min(wait_ms, 30_000) / 1000.0 if may_wait else 0.0)
            while True:
                # A rank that voted in a generation older than the one this site was
                # admitted back in must pull the state, whatever else was decided for
                # its key meanwhile (a RETRY there would rerun a step the job has left
                # behind, and wait for votes no other site will ever send).
                rejoin = self._readmitted_locked(key)
                if rejoin is not None:
                    return rejoin
                found = self._decisions.get(key)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or c._stopped.is_set():
                    return pb.Decision(step=key[0], verdict=pb.VERDICT_PENDING)
                c._cond.wait(left)

    def _readmitted_locked(self, key: tuple[int, int]) -> pb.Decision | None:
        """The REJOIN for a vote cast before this site was admitted back, else None."""
        rejoin = self._rejoin_decision
        return rejoin if rejoin is not None and key[1] < rejoin.generation else None

    def _adopt_locked(
        self,
        generation: int,
        sites: list[pb.SiteInfo],
        start_step: int,
        state_source: str,
        leader: str,
    ) -> None:
        c = self.c
        left_out = c.excluded
        for info in sites:
            if info.name != c.site:
                c._ready_sites[info.name] = info
                c.last_seen.setdefault(info.name, time.monotonic())
        c._generation = generation
        c.members = [info.name for info in sites]
        c.start_step = start_step
        c.state_source = state_source
        self._stuck_since = None
        c.joining = c.excluded = False
        for info in sites:
            self._joiners.pop(info.name, None)
            self.restarted.discard(info.name)  # a member again: its new incarnation
        log.info(
            "[%s] membership generation %d from %s: %s (from step %d)",
            c.site,
            generation,
            leader,
            ", ".join(c.members),
            start_step,
        )
        if left_out and c.site in c.members and state_source and state_source != c.site:
            # Admitted back after being left out: ranks waiting on a vote pull the state.
            self.committed_steps = start_step
            self._rejoin_decision = pb.Decision(
                step=start_step,
                verdict=pb.VERDICT_REJOIN,
                generation=generation,
                sites=sites,
                state_source=state_source,
                state_step=max(0, start_step - 1),
                reason=f"admitted again by {leader} at step {start_step}",
            )
        c._cond.notify_all()

    def _retry_locked(self, step: int, reason: str) -> pb.Decision:
        c = self.c
        return pb.Decision(
            step=step,
            verdict=pb.VERDICT_RETRY,
            generation=c._generation,
            sites=self._sites_of(c.members),
            reason=reason,
        )

    def _decide_locked(self, key: tuple[int, int], decision: pb.Decision) -> None:
        self._decisions[key] = decision
        if decision.verdict == pb.VERDICT_COMMIT:
            self.committed_steps = max(self.committed_steps, key[0] + 1)
        # Old keys go; a few steps back is enough for late askers.
        for old in [k for k in self._decisions if k[0] < key[0] - 8]:
            del self._decisions[old]
        for table in (self._rank_votes, self._site_votes):
            for old in [k for k in table if k[0] < key[0] - 8]:
                del table[old]
        log.info(
            "[%s] step %d generation %d: %s%s",
            self.c.site,
            key[0],
            key[1],
            _verdict_name(decision.verdict),
            f" -> generation {decision.generation}" if decision.generation != key[1] else "",
        )
        self.c._cond.notify_all()

    def add_joiner(self, info: pb.SiteInfo) -> None:
        """A site outside the membership asked to join (call with the condition held)."""
        if info.name not in self._joiners:
            log.info("[%s] %s asks to join; admitted at the next commit", self.c.site, info.name)
        self._joiners[info.name] = info

    # -- the loop: forward this site's votes, re-evaluate as leader --------------------------

    def _run(self) -> None:
        c = self.c
        while not c._stopped.is_set():
            with c._cond:
                # Woken at once by a rank's vote (or any other news), else every _LOOP_S:
                # a step's vote leaves for the leader without waiting for a tick.
                c._cond.wait(_LOOP_S)
                if c._generation == 0:
                    continue
                suspects = self.suspects_locked()
                if suspects != self._suspects:  # silence is noticed by time, not by a call
                    self._suspects = suspects
                    c._cond.notify_all()  # wake ranks long-polling GetMembership
                ready = [
                    key
                    for key, votes in self._rank_votes.items()
                    if len(votes) == c.ranks and key not in self._decisions
                ]
            for key in sorted(ready):
                try:
                    self._settle(key)
                except Exception:  # never let the loop die; the next pass tries again
                    log.exception("[%s] settling step %d failed", c.site, key[0])

    def _settle(self, key: tuple[int, int]) -> None:
        c = self.c
        with c._cond:
            if key[1] != c._generation:
                # Ranks voted in a generation this site has left: they run it again --
                # unless the site was admitted back since, when they pull the state
                # instead (_await hands them the REJOIN).
                readmitted = self._readmitted_locked(key) is not None
                if key not in self._decisions and c.site in c.members and not readmitted:
                    self._decide_locked(key, self._retry_locked(key[0], "generation moved on"))
                return
            leader = self._leader_locked()
            votes = self._rank_votes[key]
            ok = all(votes.values())
            suspects = self.suspects_locked()
        if leader == c.site:
            self._evaluate(key)
            return
        with c._cond:
            # The leader is silent when it is among the suspects; the next member in
            # line (maybe this site) takes over.
            if leader in suspects:
                leader = self._leader_locked()
        request = pb.SiteVoteRequest(
            site=c.site,
            step=key[0],
            generation=key[1],
            ok=ok,
            wait_ms=_FORWARD_WAIT_MS,
            suspects=suspects,
        )
        try:
            decision = c.peer_stub(leader).SiteVote(
                request, timeout=c.rpc_timeout_s + _FORWARD_WAIT_MS / 1000
            )
        except grpc.RpcError as exc:
            log.debug("[%s] vote at %s: %s", c.site, leader, exc.code().name)
            with c._cond:
                silent = leader in self.suspects_locked()
                nxt = self._leader_locked(exclude=[leader]) if silent else None
            if nxt == c.site:
                self._takeover(key, leader)
            return
        if decision.verdict == pb.VERDICT_PENDING:
            return
        if decision.verdict in (pb.VERDICT_COMMIT, pb.VERDICT_RETRY) and c.site not in [
            info.name for info in decision.sites
        ]:
            # The job went on without this site (it was taken for dead): ask to be
            # admitted again; the ranks keep waiting and get REJOIN then.
            with c._cond:
                if not c.joining:
                    log.warning(
                        "[%s] step %d went on without this site: joining again", c.site, key[0]
                    )
                c.excluded = c.joining = True
            return
        with c._cond:
            if decision.generation > c._generation and decision.verdict in (
                pb.VERDICT_COMMIT,
                pb.VERDICT_RETRY,
            ):
                # The Propose may still be on its way; the decision carries the same news.
                self._adopt_locked(
                    decision.generation,
                    list(decision.sites),
                    key[0] + 1 if decision.verdict == pb.VERDICT_COMMIT else key[0],
                    decision.state_source,
                    leader,
                )
            if key not in self._decisions:
                self._decide_locked(key, decision)
