"""One agent per host for a site's ranks there: their votes in one message, their
watches in one poll.

Per rank, 2 x 1,024 ranks' votes and watches kept the job under one step a second on 16
cores (docs/benchmarks/control-plane.md). A launcher that starts a host's ranks runs a
:class:`HostAgent` beside them, on a Unix socket in the ranks' own 0700 folder, and the
ranks send it the two requests that scale with them, as frames on one connection a rank
(agent_wire.py):

- **A vote that waits**: the first ballot of a (step, generation) waits until every rank of
  the host voted or ``linger_s`` passed; then they go as one message on the agent's
  ``HostSession`` and each rank gets the decision. A refusal of several ballots is retried
  ballot by ballot, so one rank's bad key or stale generation is that rank's alone.
- **A watch**: the agent keeps one long poll open at the coordinator and answers the
  ranks' watches from it, as the coordinator would. Its poll names the ranks it vouches
  for (vouches.py) and is sent again as soon as they change: a rank new here, one whose
  connection closed, one that stopped watching ``vouch_s`` of the agent's own time after
  its last watch ended.

The agent runs on one event loop, a thread of its own, and calls its coordinator on the
grpc.aio twin of its channel (agent_upstream.py): a gRPC server for its ranks cost ~100 µs
and two thread hand-offs a message (docs/benchmarks/control-plane.md). Everything else a
rank calls goes to the coordinator, as does a rank that cannot reach its agent: an agent
is a fast path, never the only one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from isthmus.inter.control.agent_upstream import LoopUpstream, Outcome, upstream
from isthmus.inter.control.agent_wire import Kind, RankWire
from isthmus.inter.control.vouches import AgentPoll, Vouches
from isthmus.proto import coordinator_pb2 as pb

__all__ = ["HostAgent", "quiet_closed_loop_events"]

log = logging.getLogger("isthmus.host_agent")

_RANK_WAIT_MS = 5_000  # the longest a rank's watch is held here (a rank asks for 5 s)
_RPC_SLACK_S = 5.0
_INVALID, _LATE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED


@dataclass(eq=False)
class _Watch:
    """A rank's watch, held here until news comes or its wait ends."""

    wire: RankWire
    rid: int
    request: pb.GetMembershipRequest
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Ballots:
    """The host's ballots on one (step, generation), gathered until sent."""

    request: pb.CommitHostStepRequest  # the first vote: the site, step, ... of all
    wait_ms: int
    ballots: dict[int, pb.RankBallot] = field(default_factory=dict)
    voters: list[tuple[RankWire, int, list[int]]] = field(default_factory=list)
    """Each vote's connection, request id and ranks: answered once the batch is."""
    linger: asyncio.TimerHandle | None = None


class HostAgent:
    """Votes and watches of at most ``ranks`` ranks of ``site`` on one host, at its
    coordinator, on the grpc.aio twin of ``channel`` (``peer_channel``'s: TLS and token as
    the ranks' own). ``listen``: "unix:/path", or "127.0.0.1:0", which no rank takes.
    ``linger_s``: how long the first ballot of a step waits for the host's others (free:
    the decision waits for every rank's vote anyway). ``vouch_s``: a rank heard from this
    recently (of the agent's own time, on ``clock``) is vouched for in its polls.
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ranks < 1 or linger_s < 0 or vouch_s <= 0:
            got = f"got {ranks}, {linger_s}, {vouch_s}"
            raise ValueError(f"ranks >= 1, linger_s >= 0, vouch_s > 0; {got}")
        self.site, self.ranks = site, ranks
        self.linger_s, self.vouch_s = linger_s, vouch_s
        self.address = self._listen = listen  # a port 0 is named once started
        self.votes = self.watches = self.rank_connections = 0  # what the ranks sent here
        # Everything below is the event loop's alone.
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(quiet_closed_loop_events)
        self._thread = threading.Thread(
            target=self.loop.run_forever, name=f"host-agent-{site}", daemon=True
        )
        self._channel = channel
        self.upstream: LoopUpstream | None = None  # made on the loop: grpc.aio binds to it
        self._server: asyncio.AbstractServer | None = None
        self._wires: set[RankWire] = set()  # the ranks' connections
        self._stopped = False
        self._stopping = threading.Lock()
        self._open: dict[tuple[int, int, bool], _Ballots] = {}
        self._tasks: set[asyncio.Task] = set()  # calls on their way to the coordinator
        # The watch: the coordinator's latest answer, and whom the agent vouches for.
        self._vouches = Vouches(vouch_s, clock)
        self._held: set[_Watch] = set()  # the ranks' watches held here now
        self.poll = AgentPoll(
            self._vouches, self.loop, lambda *call: self._up.poll(*call), self._publish, site
        )
        self._encoded: dict[bool, bytes] = {}  # the membership as sent, with sites or without

    @property
    def _up(self) -> LoopUpstream:
        assert self.upstream is not None, "start() makes it"
        return self.upstream

    @property
    def batches(self) -> int:
        return self.upstream.messages if self.upstream is not None else 0

    def stats(self) -> dict[str, int]:  # the ranks' requests and the coordinator's
        return {
            "ranks": self.ranks,
            "votes": self.votes,
            "vote_messages": self.batches,
            "watches": self.watches,
            "watch_polls": self.poll.polls,
            "rank_connections": self.rank_connections,
        }

    def start(self) -> HostAgent:
        """Listens and serves, from a thread of its own (``OSError`` if it cannot bind)."""
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(30)
        except BaseException:
            self._end_loop()
            raise
        return self

    async def _serve(self) -> None:
        self.upstream = upstream(self._channel, rpc_slack_s=_RPC_SLACK_S / 2)

        def wire() -> RankWire:
            self.rank_connections += 1
            made = RankWire(self._on_frame, self._on_lost)
            self._wires.add(made)
            return made

        try:
            if self._listen.startswith("unix:"):
                path = self._listen.removeprefix("unix:").removeprefix("//")
                self._server = await self.loop.create_unix_server(wire, path)
            else:
                host, _, port = self._listen.rpartition(":")
                self._server = await self.loop.create_server(wire, host, int(port))
                bound = self._server.sockets[0].getsockname()[1]
                self.address = f"{host}:{bound}"
        except (OSError, ValueError) as exc:
            raise OSError(
                f"host agent of {self.site}: cannot listen on {self._listen}: {exc}"
            ) from exc

    def stop(self) -> None:
        """Stops serving and drops the ranks' connections (they call the coordinator)."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
        if self.upstream is not None:
            self.upstream.close()  # a vote waiting on the coordinator ends now
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
            except (TimeoutError, futures.TimeoutError):
                log.warning("%s host agent: it did not stop within 10 s", self.site)
        self._end_loop()

    async def _shutdown(self) -> None:
        self.poll.close()
        for watch in self._held:
            if watch.timer is not None:
                watch.timer.cancel()
        if self._server is not None:
            self._server.close()
            if self._listen.startswith("unix:"):
                with contextlib.suppress(OSError):  # ranks that look again find none
                    os.unlink(self._listen.removeprefix("unix:").removeprefix("//"))
        for wire in list(self._wires):
            wire.abort()
        if self.upstream is not None:
            await self.upstream.aclose()
        # Every task left ends before the loop stops, else asyncio reports it destroyed.
        left = asyncio.all_tasks() - {asyncio.current_task()}
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def _end_loop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()

    def _spawn(self, call: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(call)
        self._tasks.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    def _on_frame(self, wire: RankWire, kind: int, rid: int, payload: bytes) -> None:
        try:
            if kind == Kind.VOTE:
                self._vote(wire, rid, pb.CommitHostStepRequest.FromString(payload))
            elif kind == Kind.WATCH:
                self._watch(wire, rid, pb.GetMembershipRequest.FromString(payload))
            elif kind == Kind.CANCEL:
                if rid in wire.held:
                    self._end_watch(wire.held[rid], cancelled=True)
            else:
                wire.error(rid, _INVALID, f"no request of kind {kind} here")
        except DecodeError:
            wire.error(rid, _INVALID, f"not a message of kind {kind}")

    def _on_lost(self, wire: RankWire) -> None:
        """A rank's connection closed: its watches end, its ballots not sent yet are
        withdrawn, and the agent stops vouching for it now, not ``vouch_s`` later."""
        self._wires.discard(wire)
        for watch in list(wire.held.values()):
            self._end_watch(watch, lost=True)
        if self._stopped:
            return
        for batch in self._open.values():
            gone = [rank for v in batch.voters if v[0] is wire for rank in v[2]]
            batch.ballots = {r: b for r, b in batch.ballots.items() if r not in gone}
            batch.voters = [v for v in batch.voters if v[0] is not wire]
        others = set().union(*(w.keys for w in self._wires))
        if any([self._vouches.forget(key) for key in wire.keys - others]):
            self.poll.changed()
            self.poll.arm_expiry()
        for key, batch in list(self._open.items()):  # a batch it was last in goes now
            if len(batch.ballots) >= self._expected() or not batch.ballots:
                self._seal(key, batch)

    def _vote(self, wire: RankWire, rid: int, request: pb.CommitHostStepRequest) -> None:
        """A rank's ballots join the host's batch; the rank is answered when the batch is."""
        if request.wait_ms <= 0 or not request.ballots:  # the coordinator's to answer
            wire.error(rid, _INVALID, "a vote through the host agent has ballots and waits")
            return
        wire.keys.update(ballot.rank_key for ballot in request.ballots)
        key = (request.step, request.generation, request.sites_known)
        self.votes += len(request.ballots)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Ballots(request, request.wait_ms)
            batch.linger = self.loop.call_later(self.linger_s, self._seal, key, batch)
        for ballot in request.ballots:
            batch.ballots[ballot.rank] = ballot
        batch.voters.append((wire, rid, [ballot.rank for ballot in request.ballots]))
        batch.wait_ms = min(batch.wait_ms, request.wait_ms)
        if len(batch.ballots) >= self._expected():
            self._seal(key, batch)

    def _expected(self) -> int:
        """Ballots a step's batch waits for: one from each rank watching here (every rank
        watches before it votes), at most ``ranks``; all ``ranks`` before any watches. A
        dead rank is not waited for, nor ranks an agent was told of too many (srun's)."""
        watching = len(self._vouches)
        return min(self.ranks, watching) if watching else self.ranks

    def _seal(self, key: tuple[int, int, bool], batch: _Ballots) -> None:
        """No more ballots join ``batch``: it goes to the coordinator."""
        if self._open.get(key) is not batch:
            return  # sealed already (full, then its linger ran out)
        del self._open[key]
        if batch.linger is not None:
            batch.linger.cancel()
        if batch.ballots:  # else its ranks' connections all closed
            self._spawn(self._send(batch))

    async def _send(self, batch: _Ballots) -> None:
        outcome = await self._up.votes(batch.request, list(batch.ballots.values()), batch.wait_ms)
        encoded: dict[int, bytes] = {}  # a decision, serialized once for the host's ranks
        for wire, rid, ranks in batch.voters:
            mine: list[Outcome | None] = [outcome.get(rank) for rank in ranks]
            refused = [o for o in mine if not isinstance(o, pb.Decision)]
            if refused:
                code, details = refused[0] or (_LATE, "the host's vote got no answer in time")
                wire.error(rid, code, details)  # UNAVAILABLE: the rank votes elsewhere
                continue
            decision = mine[0]
            assert isinstance(decision, pb.Decision)
            if id(decision) not in encoded:
                encoded[id(decision)] = decision.SerializeToString()
            wire.send(Kind.DECISION, rid, encoded[id(decision)])

    def _watch(self, wire: RankWire, rid: int, request: pb.GetMembershipRequest) -> None:
        """A rank's watch: answered at once on news, else held until some comes or its
        wait (5 s at most) ends."""
        if request.known_generation == 0 or not request.rank_key:
            wire.error(rid, _INVALID, "a first membership is the coordinator's to answer")
            return
        wire.keys.add(request.rank_key)
        watch = wire.held[rid] = _Watch(wire, rid, request)
        self.watches += 1
        if self._vouches.hold(request.rank_key):
            self.poll.changed()  # a rank new here: the coordinator hears of it at once
        if self.poll.seen and self._answer_now(request.known_generation):
            self._end_watch(watch)
            return
        wait_s = max(0, min(request.wait_ms, _RANK_WAIT_MS)) / 1000
        watch.timer = self.loop.call_later(wait_s, self._end_watch, watch)
        self._held.add(watch)

    def _end_watch(self, watch: _Watch, *, cancelled: bool = False, lost: bool = False) -> None:
        """Answers ``watch`` with what the agent knows (or its end)."""
        wire, rid = watch.wire, watch.rid
        if wire.held.pop(rid, None) is None:
            return  # ended already
        self._held.discard(watch)
        if watch.timer is not None:
            watch.timer.cancel()
        self._vouches.release(watch.request.rank_key)
        self.poll.arm_expiry()
        if lost:
            return
        if cancelled:
            wire.error(rid, grpc.StatusCode.CANCELLED, "the rank cancelled its watch")
        elif not self.poll.seen:  # no answer of the agent's own yet: the coordinator's
            self._spawn(self._pass(watch))
        elif self.poll.error is not None:  # a refusal (FAILED_PRECONDITION: job failed)
            error = self.poll.error
            wire.error(rid, error.code(), error.details() or "")
        else:
            membership = self.poll.membership
            unchanged = watch.request.known_generation == membership.generation
            if unchanged not in self._encoded:
                reply = membership
                if unchanged and reply.sites:  # the rank has them
                    reply = pb.GetMembershipResponse()
                    reply.CopyFrom(membership)
                    del reply.sites[:]
                self._encoded[unchanged] = reply.SerializeToString()
            wire.send(Kind.MEMBERSHIP, rid, self._encoded[unchanged])

    async def _pass(self, watch: _Watch) -> None:
        """``watch`` asked of the coordinator, answered at once (its wait is spent)."""
        request = pb.GetMembershipRequest()
        request.CopyFrom(watch.request)
        request.wait_ms = 0
        try:
            reply = await self._up.call("GetMembership", request, _RPC_SLACK_S)
        except grpc.RpcError as exc:
            # Never UNAVAILABLE from here: that code tells a rank its agent is gone.
            code = exc.code()
            late = code is grpc.StatusCode.UNAVAILABLE
            watch.wire.error(watch.rid, _LATE if late else code, exc.details() or "")
            return
        watch.wire.send(Kind.MEMBERSHIP, watch.rid, reply.SerializeToString())

    def _answer_now(self, known: int) -> bool:
        now = self.poll.membership
        return self.poll.error is not None or now.generation > known or bool(now.suspects)

    def _publish(self) -> None:
        """The agent's poll was answered: the watches its answer is news to end now."""
        self._encoded.clear()
        for watch in [w for w in self._held if self._answer_now(w.request.known_generation)]:
            self._end_watch(watch)


def quiet_closed_loop_events(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: grpc.aio's one completion queue per process hands each
    loop its calls' events, and one of a call made on another agent's loop that stopped
    meanwhile fails with "Event loop is closed". That loop's calls are over: no fault."""
    exc = context.get("exception")
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        log.debug("host agent: an event for a stopped agent's loop: %s", context.get("message"))
        return
    loop.default_exception_handler(context)
