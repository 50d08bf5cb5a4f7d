"""One agent per host for a site's ranks there: their votes in one message, their
watches in one poll.

Per rank, a site of 1,024 ranks costs its coordinator 1,024 vote messages a step and
about 2,048 watch calls a second (each rank's 1 s long poll, answered and sent again);
at 2 x 1,024 ranks that kept the job under one step a second on 16 cores
(docs/benchmarks.md, "The control plane at scale"). A launcher that starts a host's
ranks (deploy/launch/ranks.py) runs a :class:`HostAgent` beside them, on a Unix socket
in the ranks' own 0700 folder (no other user of the machine can reach it), and the ranks
send it the two calls that scale with them:

- **``CommitStep``, a vote that waits.** The agent gathers the host's ballots on one
  (step, generation): the first one in waits until every rank of the host voted or
  ``linger_s`` passed, then sends them all as one message on a :class:`HostSession`
  and hands each rank the decision. A refusal of several ballots is retried ballot by
  ballot, so one rank's bad key or stale generation is that rank's alone. A vote that
  does not wait (a vote ahead) is passed through as a call.
- **``GetMembership``, a rank's watch.** The agent keeps one long poll open at the
  coordinator and answers the ranks' polls from it, as the coordinator would (at once
  on a newer generation, a suspect or an error; else when the wait ends). Its poll
  names the ranks it heard from within ``vouch_s`` (``vouched_rank_keys``): the
  coordinator counts a poll in flight for each (inter/control/rank_liveness.py). The
  poll is held up to 10 s and sent again, naming them, as soon as those ranks change,
  so a rank that dies is vouched for no more than ``vouch_s`` and half a second after
  its last watch, and is declared dead as before, that much later.

Everything else a rank calls (registration, reports, a first membership) goes to the
coordinator itself, and a rank that cannot reach its agent falls back to the
coordinator too (inter/control/coordinator_client.py): an agent is a fast path, never the
only one.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from isthmus.inter.control.host_session import HostSession
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["HostAgent"]

log = logging.getLogger("isthmus.host_agent")

_REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
_RANK_WAIT_MS = 5_000
"""The longest a rank's watch is held here (a rank's own ask for 1 s)."""
_AGENT_WAIT_MS = 10_000
"""How long the agent's own poll may be held: it is answered at once on news like a
rank's, so a longer wait costs nothing but the polls it saves (a 1 s poll a host is
2,048 calls a second at 16k ranks, what each rank's own watch cost at 2 x 1,024)."""
_RECHECK_S = 0.5
"""How often the agent checks, while its poll waits, whether its ranks changed."""
_RPC_SLACK_S = 5.0


_Status = tuple[grpc.StatusCode, str]
"""An upstream refusal or failure, handed to a rank as its call's status."""


@dataclass
class _Ballots:
    """The host's ballots on one (step, generation), gathered until sent."""

    ballots: dict[int, pb.RankBallot] = field(default_factory=dict)
    wait_ms: int = 0
    outcome: dict[int, pb.Decision | _Status] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


class HostAgent(pb_grpc.CoordinatorServicer):
    """Votes and watches of one host's ranks of ``site``, at its coordinator.

    Args:
        channel: a channel to the site's coordinator (TLS and token as the ranks' own).
        site: the site's name.
        ranks: how many of the site's ranks run on this host (and use this agent), at
            most: a step's ballots are sent once every rank watching here voted.
        listen: where the ranks reach the agent ("unix:/path" or "127.0.0.1:0").
        linger_s: how long the first ballot of a step waits for the host's others.
            Waiting costs the step nothing: its decision waits for every rank's vote
            anyway (a site votes once all its ranks did), so this only bounds how late
            a rank may be and still share the message (on a loaded host the votes of
            one step spread over more than 50 ms, and took three messages a host).
        vouch_s: a rank heard from this recently is vouched for in the agent's polls.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        site: str,
        ranks: int,
        listen: str,
        linger_s: float = 0.25,
        vouch_s: float = 2.0,
    ) -> None:
        if ranks < 1 or linger_s < 0 or vouch_s <= 0:
            raise ValueError(
                f"ranks >= 1, linger_s >= 0, vouch_s > 0; got {ranks}, {linger_s}, {vouch_s}"
            )
        self.site, self.ranks = site, ranks
        self.linger_s, self.vouch_s = linger_s, vouch_s
        self._stub = pb_grpc.CoordinatorStub(channel)
        self._lock = threading.Condition()
        self._open: dict[tuple[int, int, bool], _Ballots] = {}
        self._sessions: list[HostSession] = []  # free ones; one per batch in flight
        self._opened: list[HostSession] = []  # every one, for stop()
        self.batches = 0
        """Messages of ballots sent to the coordinator."""
        self.votes = 0
        """Votes the ranks sent here (each answered by the decision of a batch)."""
        self.watches = 0
        """Watch polls the ranks sent here."""
        self.polls = 0
        """Polls the agent sent the coordinator for them."""
        # The watch: the coordinator's latest answer, and who asked for it.
        self._membership = pb.GetMembershipResponse()
        self._membership_error: grpc.RpcError | None = None
        self._seen = False  # the agent's poll was answered once: it answers watches itself
        self._watching = 0  # ranks' watches in flight here
        self._last_watch: float | None = None  # when one last ended
        self._news = threading.Condition()
        self._heard: dict[str, float] = {}  # rank key -> when its watch last reached us
        self._stopped = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=3 * ranks + 4))
        pb_grpc.add_CoordinatorServicer_to_server(self, self._server)
        port = self._server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"host agent of {site}: cannot listen on {listen}")
        self.address = (
            listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"
        )
        self._watcher = threading.Thread(target=self._watch, name="host-agent-watch", daemon=True)

    def idle_for(self) -> float:
        """Seconds since the last watch of a rank here ended, none being in flight (0
        before any rank watched): how long the host has had no rank of the site."""
        with self._news:
            if self._watching or self._last_watch is None:
                return 0.0
            return time.monotonic() - self._last_watch

    def stats(self) -> dict[str, int]:
        """What the agent carried so far: the ranks' calls and the coordinator's."""
        return {
            "ranks": self.ranks,
            "votes": self.votes,
            "vote_messages": self.batches,
            "watches": self.watches,
            "watch_polls": self.polls,
        }

    def start(self) -> HostAgent:
        self._server.start()
        self._watcher.start()
        return self

    def stop(self) -> None:
        """Stops serving (ranks fall back to the coordinator) and ends its streams."""
        self._stopped.set()
        with self._news:
            self._news.notify_all()
        with self._lock:
            sessions, self._sessions, self._opened = self._opened, [], []
        for session in sessions:  # a vote waiting on one ends now (CANCELLED)
            session.close()
        self._server.stop(grace=0.5).wait()
        self._watcher.join(_RECHECK_S + _RPC_SLACK_S)

    # -- votes -------------------------------------------------------------------------

    def CommitStep(self, request, context):  # noqa: N802
        if request.wait_ms == 0:  # a vote ahead: nothing waits on it, pass it through
            return self._pass(self._stub.CommitStep, request, context)
        key = (request.step, request.generation, request.sites_known)
        ballot = pb.RankBallot(rank=request.rank, ok=request.ok, rank_key=request.rank_key)
        with self._lock:
            self.votes += 1
            batch = self._open.get(key)
            first = batch is None
            if first:
                batch = self._open[key] = _Ballots(wait_ms=request.wait_ms)
            batch.ballots[request.rank] = ballot
            batch.wait_ms = min(batch.wait_ms, request.wait_ms)
            expected = self._expected()
            if len(batch.ballots) >= expected:
                self._lock.notify_all()
            if first:  # this call sends the host's ballots, once the others are in
                self._lock.wait_for(lambda: len(batch.ballots) >= expected, self.linger_s)
                del self._open[key]
        if first:
            self._send(request, batch)
        remaining = context.time_remaining()
        batch.done.wait(None if remaining is None else max(0.0, remaining))
        outcome = batch.outcome.get(request.rank)
        if outcome is None:
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, "the host's vote got no answer in time"
            )
        if isinstance(outcome, tuple):
            context.abort(*outcome)
        return outcome

    def _expected(self) -> int:
        """Ballots a step's batch waits for: one from each rank watching through this
        agent (every rank watches before it votes), at most ``ranks``; all ``ranks``
        before any watches. A rank of the host that died is not waited for, and an
        agent told too many ranks (srun's layout guessed) never lingers for them."""
        watching = len(self._vouched())
        return min(self.ranks, watching) if watching else self.ranks

    @staticmethod
    def _pass(call, request, context):
        """``request`` to the coordinator as it came; its refusal is the rank's."""
        try:
            return call(request, timeout=context.time_remaining())
        except grpc.RpcError as exc:
            # Never UNAVAILABLE from here: that code tells a rank its agent is gone.
            code = exc.code()
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED if code is grpc.StatusCode.UNAVAILABLE else code
            )
            context.abort(code, exc.details() or "")

    def _send(self, request, batch: _Ballots) -> None:
        """Sends ``batch`` (all its ballots at once; one by one if that was refused)."""
        session = self._session()
        try:
            ballots = list(batch.ballots.values())
            outcome = self._vote(session, request, ballots, batch.wait_ms)
            if isinstance(outcome, tuple) and outcome[0] in _REFUSED and len(ballots) > 1:
                for ballot in ballots:  # whose ballot was refused: each on its own
                    batch.outcome[ballot.rank] = self._vote(
                        session, request, [ballot], batch.wait_ms
                    )
            else:
                batch.outcome.update((b.rank, outcome) for b in ballots)
        finally:
            with self._lock:
                self._sessions.append(session)
            batch.done.set()

    def _vote(self, session: HostSession, request, ballots, wait_ms: int):
        if self._stopped.is_set():  # its channel closes next: the rank votes elsewhere
            return grpc.StatusCode.UNAVAILABLE, f"{self.site} host agent stopped"
        with self._lock:
            self.batches += 1
        try:
            return session.vote(
                pb.CommitHostStepRequest(
                    site=request.site,
                    step=request.step,
                    generation=request.generation,
                    ballots=ballots,
                    wait_ms=wait_ms,
                    sites_known=request.sites_known,
                )
            )
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        except TimeoutError as exc:  # the session went silent: the rank votes again
            return grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.site} host agent: {exc}"

    def _session(self) -> HostSession:
        with self._lock:
            if self._sessions:
                return self._sessions.pop()
            # Less slack than the ranks' calls have: a silent stream is the agent's to
            # notice, so the rank gets an answer (and votes again) before its deadline.
            session = HostSession(self._stub, rpc_slack_s=_RPC_SLACK_S / 2)
            self._opened.append(session)
            return session

    # -- watches -----------------------------------------------------------------------

    def GetMembership(self, request, context):  # noqa: N802
        if request.known_generation == 0 or not request.rank_key:
            # A rank's first membership, or no rank's poll: the coordinator's to answer.
            return self._pass(self._stub.GetMembership, request, context)
        known = request.known_generation
        deadline = time.monotonic() + min(request.wait_ms, _RANK_WAIT_MS) / 1000
        with self._news:
            self.watches += 1
            self._watching += 1
            self._heard[request.rank_key] = float("inf")  # in flight: vouched for
            self._news.notify_all()  # the first watch starts the agent's poll
            seen = self._seen
        if not seen:  # no answer of the agent's own yet: the coordinator's, as it stands
            try:
                return self._pass(self._stub.GetMembership, request, context)
            finally:
                self._watch_ended(request.rank_key)
        with self._news:
            try:
                while not self._answer_now(known) and not self._stopped.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0 or not context.is_active():
                        break
                    self._news.wait(left)
            finally:
                self._watch_ended(request.rank_key)
            error, now = self._membership_error, self._membership
        if error is not None:  # a refusal (FAILED_PRECONDITION: the job failed)
            context.abort(error.code(), error.details() or "")
        reply = pb.GetMembershipResponse()
        reply.CopyFrom(now)
        if known == now.generation:
            del reply.sites[:]  # the rank has them
        return reply

    def _watch_ended(self, key: str) -> None:
        with self._news:  # re-entrant: a Condition over an RLock
            now = time.monotonic()
            self._heard[key] = self._last_watch = now
            self._watching -= 1

    def _answer_now(self, known: int) -> bool:
        now = self._membership
        return self._membership_error is not None or now.generation > known or bool(now.suspects)

    def _vouched(self) -> list[str]:
        cutoff = time.monotonic() - self.vouch_s
        with self._news:
            for key in [k for k, at in self._heard.items() if at < cutoff]:
                del self._heard[key]
            return sorted(self._heard)

    def _poll(self, known: int, keys: list[str]) -> pb.GetMembershipResponse:
        """One long poll at the coordinator, vouching for ``keys``; cancelled as soon as
        the ranks to vouch for are others (one fell silent, or one more watches), so a
        dead rank is vouched for no longer than ``vouch_s`` and a recheck after it."""
        call = self._stub.GetMembership.future(
            pb.GetMembershipRequest(
                known_generation=known,
                wait_ms=_AGENT_WAIT_MS if known else 0,
                rank_key=keys[0],
                vouched_rank_keys=keys,
            ),
            timeout=_AGENT_WAIT_MS / 1000 + _RPC_SLACK_S,
        )
        while True:
            try:
                return call.result(timeout=_RECHECK_S)
            except grpc.FutureTimeoutError:
                if self._stopped.is_set() or self._vouched() != keys:
                    call.cancel()

    def _watch(self) -> None:
        # One long poll at a time for the host, with the keys of the ranks it speaks for.
        known = 0
        while not self._stopped.is_set():
            keys = self._vouched()
            if not keys:  # no rank watches: wait for one
                with self._news:
                    self._news.wait(self.vouch_s)
                continue
            self.polls += 1
            try:
                reply = self._poll(known, keys)
            except grpc.FutureCancelledError:
                continue  # the ranks it vouches for changed: ask again, naming them
            except grpc.RpcError as exc:
                refused = exc.code() in _REFUSED
                with self._news:
                    self._membership_error = exc if refused else None
                    self._news.notify_all()
                if not refused:
                    log.debug("%s host agent: membership poll failed: %s", self.site, exc)
                self._stopped.wait(0.25)
                continue
            with self._news:
                if reply.generation != known or reply.sites:
                    if not reply.sites and reply.generation == self._membership.generation:
                        reply.sites.extend(self._membership.sites)
                    self._membership = reply
                else:
                    del self._membership.suspects[:]
                    self._membership.suspects.extend(reply.suspects)
                self._membership_error = None
                self._seen = True
                self._news.notify_all()
            known = reply.generation
            if reply.suspects or not known:
                self._stopped.wait(0.25)  # answered at once and would be again: pace it
