"""One agent per host for a site's ranks there: their votes in one message, their
watches in one poll.

Per rank, a site of 1,024 ranks costs its coordinator 1,024 vote messages a step and a
watch call a rank every few seconds; at 2 x 1,024 ranks that kept the job under one step a
second on 16 cores (docs/benchmarks.md, "The control plane at scale"). A launcher that
starts a host's ranks (deploy/launch/ranks.py) runs a :class:`HostAgent` beside them, on
a Unix socket in the ranks' own 0700 folder (no other user of the machine can reach it),
and the ranks send it the two calls that scale with them:

- **A vote that waits**, a message on the rank's own ``HostSession`` stream to the
  agent (``CommitStep`` and ``CommitHostStep`` calls are taken too). The agent gathers
  the host's ballots on one (step, generation): the first one in waits until every rank
  of the host voted or ``linger_s`` passed, then they go as one message on a
  ``HostSession`` of the agent's and each rank gets the decision. A refusal of several
  ballots is retried ballot by ballot, so one rank's bad key or stale generation is that
  rank's alone. A vote that does not wait (a vote ahead) is passed through as a call.
- **``GetMembership``, a rank's watch.** The agent keeps one long poll open at the
  coordinator and answers the ranks' polls from it, as the coordinator would (at once
  on a newer generation, a suspect or an error; else when the wait ends). Its poll
  names the ranks it hears from (``vouched_rank_keys``, inter/control/vouches.py): the
  coordinator counts a poll in flight for each (inter/control/rank_liveness.py). The
  poll is held as long as the coordinator holds it (half the silence at most) and sent
  again, naming them, as soon as those ranks change:
  a rank whose watch arrives for the first time at once, one that stopped watching
  ``vouch_s`` of the agent's own time after its last watch ended (an agent that was
  starved of CPU does not take its own lateness for its ranks' silence).

The agent runs on one event loop (``grpc.aio``, a thread of its own): a rank's vote or
watch held here is a coroutine, not a thread, and news wakes only the calls it answers.
The thread-per-call agent before it cost 12-16 ms of CPU a host a step (8 ranks' votes
and 1 s watches, each a pool thread woken through one condition, and a poll re-checked
twice a second), and 256 of them on 2 cores could not decide a step of 2 x 1,024 ranks
in 60 s (docs/benchmarks.md, "Real host agents, a process each"). It calls its
coordinator from the same loop, on the grpc.aio twin of the channel it is handed (TLS and
token as the ranks' own: inter/control/agent_upstream.py).

Everything else a rank calls (registration, reports, a first membership) goes to the
coordinator itself, and a rank that cannot reach its agent falls back to the
coordinator too (inter/control/coordinator_client.py): an agent is a fast path, never the
only one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from isthmus.inter.control.agent_upstream import (
    REFUSED,
    STOPPED,
    LoopUpstream,
    Outcome,
    ThreadUpstream,
    upstream,
)
from isthmus.inter.control.vouches import Vouches
from isthmus.proto import coordinator_pb2 as pb

__all__ = ["HostAgent"]

log = logging.getLogger("isthmus.host_agent")

_SERVICE = "isthmus.v1.Coordinator"
_RANK_WAIT_MS = 5_000
"""The longest a rank's watch is held here (a rank asks for 5 s: inter/data/membership.py)."""
_AGENT_WAIT_MS = 10_000
"""How long the agent's own poll may be held: it is answered at once on news like a
rank's, so a longer wait costs nothing but the polls it saves (the coordinator holds a
poll that vouches half its silence at most)."""
_PACE_S = 0.25
"""After an answer that would come at once again (a suspect, no generation, an error):
the pause before the next poll."""
_RPC_SLACK_S = 5.0


@dataclass
class _Ballots:
    """The host's ballots on one (step, generation), gathered until sent."""

    request: pb.CommitStepRequest | pb.CommitHostStepRequest
    """The first ballot's call: the site, step, generation and ``sites_known`` of all."""
    outcome: asyncio.Future
    """rank -> its decision or status, once the coordinator answered."""
    ballots: dict[int, pb.RankBallot] = field(default_factory=dict)
    wait_ms: int = 0
    linger: asyncio.TimerHandle | None = None


class HostAgent:
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
        vouch_s: a rank heard from this recently (of the agent's own time) is vouched
            for in the agent's polls (inter/control/vouches.py).
        clock: seconds, monotonic: what the agent's own time is measured on.
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
            raise ValueError(
                f"ranks >= 1, linger_s >= 0, vouch_s > 0; got {ranks}, {linger_s}, {vouch_s}"
            )
        self.site, self.ranks = site, ranks
        self.linger_s, self.vouch_s = linger_s, vouch_s
        self.address = listen
        """Where the ranks reach the agent (a port bound to 0 is named once started)."""
        self._listen = listen
        self._clock = clock
        self.votes = 0
        """Votes the ranks sent here (each answered by the decision of a batch)."""
        self.watches = 0
        """Watch polls the ranks sent here."""
        self.polls = 0
        """Polls the agent sent the coordinator for them."""
        self.rank_streams = 0
        """Vote streams the ranks opened here (each rank keeps one)."""
        # Everything below but the sessions is the event loop's alone.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"host-agent-{site}", daemon=True
        )
        self._channel = channel
        self._upstream: LoopUpstream | ThreadUpstream | None = None
        """The way to the coordinator, made on the loop (start): a grpc.aio twin binds to it."""
        self._server: grpc.aio.Server | None = None
        self._stopped = False
        self._stopping = threading.Lock()
        self._open: dict[tuple[int, int, bool], _Ballots] = {}
        self._sending: set[asyncio.Task] = set()  # batches on their way to the coordinator
        # The watch: the coordinator's latest answer, and whom the agent vouches for.
        self._vouches = Vouches(vouch_s, clock)
        self._membership = pb.GetMembershipResponse()
        self._membership_error: grpc.RpcError | None = None
        self._seen = False  # the agent's poll was answered once: it answers watches itself
        self._news = asyncio.Event()  # set (and replaced) on each answer of the agent's poll
        self._watching = 0  # ranks' watches held here now
        self._last_watch: float | None = None  # when a rank's watch last ended
        self._known = 0  # the generation the agent's poll knows
        self._poll: Any = None  # the agent's poll in flight (cancel, cancelled, result)
        self._poll_keys: list[str] = []
        self._pacing: asyncio.TimerHandle | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_due: float | None = None

    def idle_for(self) -> float:
        """Seconds since the last watch of a rank here ended, none being in flight (0
        before any rank watched): how long the host has had no rank of the site."""
        last = self._last_watch
        if self._watching or last is None:
            return 0.0
        return max(0.0, self._clock() - last)

    @property
    def _up(self) -> LoopUpstream | ThreadUpstream:
        assert self._upstream is not None, "start() makes it"
        return self._upstream

    @property
    def batches(self) -> int:
        """Messages of ballots sent to the coordinator."""
        return self._upstream.messages if self._upstream is not None else 0

    def stats(self) -> dict[str, int]:
        """What the agent carried so far: the ranks' calls and the coordinator's."""
        return {
            "ranks": self.ranks,
            "votes": self.votes,
            "vote_messages": self.batches,
            "watches": self.watches,
            "watch_polls": self.polls,
            "rank_streams": self.rank_streams,
        }

    def start(self) -> HostAgent:
        """Listens and serves, from a thread of its own.

        Raises:
            OSError: ``listen`` cannot be bound.
        """
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(30)
        except BaseException:
            self._end_loop()
            raise
        return self

    async def _serve(self) -> None:
        self._upstream = upstream(self._channel, self._loop, rpc_slack_s=_RPC_SLACK_S / 2)
        handlers = {
            "CommitStep": grpc.unary_unary_rpc_method_handler(
                self.CommitStep,
                request_deserializer=pb.CommitStepRequest.FromString,
                response_serializer=pb.Decision.SerializeToString,
            ),
            "CommitHostStep": grpc.unary_unary_rpc_method_handler(
                self.CommitHostStep,
                request_deserializer=pb.CommitHostStepRequest.FromString,
                response_serializer=pb.Decision.SerializeToString,
            ),
            "HostSession": grpc.stream_stream_rpc_method_handler(
                self.HostSession,
                request_deserializer=pb.CommitHostStepRequest.FromString,
                response_serializer=pb.Decision.SerializeToString,
            ),
            "GetMembership": grpc.unary_unary_rpc_method_handler(
                self.GetMembership,
                request_deserializer=pb.GetMembershipRequest.FromString,
                response_serializer=pb.GetMembershipResponse.SerializeToString,
            ),
        }
        # A rank holds two calls here at most (a vote, a watch); a third each is slack.
        server = grpc.aio.server(
            handlers=[grpc.method_handlers_generic_handler(_SERVICE, handlers)],
            maximum_concurrent_rpcs=3 * self.ranks + 4,
        )
        try:
            port = server.add_insecure_port(self._listen)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"host agent of {self.site}: cannot listen on {self._listen}")
        if not self._listen.startswith("unix:"):
            self.address = f"{self._listen.rsplit(':', 1)[0]}:{port}"
        await server.start()
        self._server = server

    def stop(self) -> None:
        """Stops serving (ranks fall back to the coordinator) and ends its streams."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
        if self._upstream is not None:
            self._upstream.close()  # a vote waiting on the coordinator ends now
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            except (TimeoutError, futures.TimeoutError):
                log.warning("%s host agent: its server did not stop within 10 s", self.site)
        self._end_loop()

    async def _shutdown(self) -> None:
        self._publish()  # the watches held here end now
        for timer in (self._pacing, self._expiry):
            if timer is not None:
                timer.cancel()
        if self._poll is not None:
            self._poll.cancel()
        if self._upstream is not None:
            await self._upstream.aclose()
        if self._server is not None:
            await self._server.stop(0.5)
        await self._loop.shutdown_asyncgens()  # the ranks' vote streams, closed here

    def _end_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()

    async def _pass(self, method: str, request, context: grpc.aio.ServicerContext):
        """``request`` to the coordinator as it came; its refusal is the rank's."""
        try:
            return await self._up.call(method, request, context.time_remaining())
        except grpc.RpcError as exc:
            # Never UNAVAILABLE from here: that code tells a rank its agent is gone.
            code = exc.code()
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED if code is grpc.StatusCode.UNAVAILABLE else code
            )
            await context.abort(code, exc.details() or "")

    # -- votes -------------------------------------------------------------------------

    async def CommitStep(self, request, context):  # noqa: N802
        if request.wait_ms == 0:  # a vote ahead: nothing waits on it, pass it through
            return await self._pass("CommitStep", request, context)
        ballot = pb.RankBallot(rank=request.rank, ok=request.ok, rank_key=request.rank_key)
        return await self._answer(await self._cast(request, [ballot]), context)

    async def CommitHostStep(self, request, context):  # noqa: N802
        if request.wait_ms == 0 or not request.ballots:  # the coordinator's to answer
            return await self._pass("CommitHostStep", request, context)
        return await self._answer(await self._cast(request, request.ballots), context)

    async def HostSession(self, requests, context):  # noqa: N802
        # A rank's own stream of waiting votes (inter/control/coordinator_client.py):
        # a vote is a message on it, a fraction of a call's cost here. Answered in order,
        # each as CommitHostStep would be; a refusal ends the stream with its status.
        self.rank_streams += 1
        async for request in requests:
            if request.wait_ms == 0 or not request.ballots:
                yield await self._pass("CommitHostStep", request, context)
            else:
                yield await self._answer(await self._cast(request, request.ballots), context)

    async def _cast(self, request, ballots) -> Outcome:
        """``ballots`` of ``request``'s (step, generation) join the host's batch; the
        outcome of the batch for them (one, or the first refusal among theirs)."""
        key = (request.step, request.generation, request.sites_known)
        self.votes += len(ballots)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Ballots(request, self._loop.create_future())
            batch.wait_ms = request.wait_ms
            batch.linger = self._loop.call_later(self.linger_s, self._seal, key, batch)
        for ballot in ballots:
            batch.ballots[ballot.rank] = ballot
        batch.wait_ms = min(batch.wait_ms, request.wait_ms)
        if len(batch.ballots) >= self._expected():
            self._seal(key, batch)
        # The rank's deadline cancels this wait (gRPC cancels the call), not the batch's.
        outcomes = await asyncio.shield(batch.outcome)
        mine = [outcomes.get(ballot.rank) for ballot in ballots]
        refused = [o for o in mine if not isinstance(o, pb.Decision)]
        if refused:
            return refused[0] or (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the host's vote got no answer in time",
            )
        return mine[0]

    @staticmethod
    async def _answer(outcome: Outcome, context) -> pb.Decision:
        if isinstance(outcome, tuple):
            await context.abort(*outcome)  # raises
        assert isinstance(outcome, pb.Decision)
        return outcome

    def _expected(self) -> int:
        """Ballots a step's batch waits for: one from each rank watching through this
        agent (every rank watches before it votes), at most ``ranks``; all ``ranks``
        before any watches. A rank of the host that died is not waited for, and an
        agent told too many ranks (srun's layout guessed) never lingers for them."""
        watching = len(self._vouches)
        return min(self.ranks, watching) if watching else self.ranks

    def _seal(self, key: tuple[int, int, bool], batch: _Ballots) -> None:
        """No more ballots join ``batch``: it goes to the coordinator."""
        if self._open.get(key) is not batch:
            return  # sealed already (full, then its linger ran out)
        del self._open[key]
        if batch.linger is not None:
            batch.linger.cancel()
        task = self._loop.create_task(self._send(batch))
        self._sending.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: _Ballots) -> None:
        ballots = list(batch.ballots.values())
        try:
            outcome = await self._up.votes(batch.request, ballots, batch.wait_ms)
        except asyncio.CancelledError:  # the agent stopped: its ranks vote elsewhere
            outcome = dict.fromkeys(batch.ballots, STOPPED)
        if not batch.outcome.done():
            batch.outcome.set_result(outcome)

    # -- watches -----------------------------------------------------------------------

    async def GetMembership(self, request, context):  # noqa: N802
        if request.known_generation == 0 or not request.rank_key:
            # A rank's first membership, or no rank's poll: the coordinator's to answer.
            return await self._pass("GetMembership", request, context)
        known = request.known_generation
        deadline = self._loop.time() + min(request.wait_ms, _RANK_WAIT_MS) / 1000
        self.watches += 1
        self._watching += 1
        if self._vouches.hold(request.rank_key):
            self._repoll()  # a rank new here: the coordinator hears of it at once
        try:
            while not self._stopped and not (self._seen and self._answer_now(known)):
                left = deadline - self._loop.time()
                if left <= 0:
                    break
                news = self._news
                try:
                    await asyncio.wait_for(news.wait(), left)
                except TimeoutError:
                    break
        finally:  # answered, or cancelled: the rank's process ended, or its call did
            self._vouches.release(request.rank_key)
            self._watching -= 1
            self._last_watch = self._clock()
            self._arm_expiry()
        if not self._seen:  # no answer of the agent's own in time: the coordinator's
            return await self._pass("GetMembership", request, context)
        if self._membership_error is not None:  # a refusal (FAILED_PRECONDITION: job failed)
            error = self._membership_error
            await context.abort(error.code(), error.details() or "")
        reply = pb.GetMembershipResponse()
        reply.CopyFrom(self._membership)
        if known == reply.generation:
            del reply.sites[:]  # the rank has them
        return reply

    def _answer_now(self, known: int) -> bool:
        now = self._membership
        return self._membership_error is not None or now.generation > known or bool(now.suspects)

    def _publish(self) -> None:
        """Wakes the watches held here: the agent's poll was answered."""
        news, self._news = self._news, asyncio.Event()
        news.set()

    def _arm_expiry(self) -> None:
        """The timer of the next check of the ranks vouched for (:meth:`_expire`)."""
        due = self._vouches.next_check()
        if due == self._expiry_due:
            return
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._expiry_due = due
        if due is not None and not self._stopped:
            delay = max(0.0, due - self._vouches.time.now())
            self._expiry = self._loop.call_later(delay, self._expire, due)

    def _expire(self, due: float) -> None:
        self._expiry, self._expiry_due = None, None
        if self._vouches.check(due):
            self._repoll()  # a rank fell silent: the poll names it no more
        self._arm_expiry()

    def _repoll(self) -> None:
        """Sends the agent's poll when none is in flight, or cancels the one in flight
        when it names other ranks than those to vouch for now (its end sends the next)."""
        if self._stopped or self._pacing is not None:
            return
        keys = self._vouches.keys()
        if self._poll is not None:
            # A poll that knows no generation is answered at once: the next names them.
            if self._known and keys != self._poll_keys:
                self._poll.cancel()
            return
        if not keys:  # no rank watches: the next watch sends it
            return
        self.polls += 1
        known = self._known
        self._poll_keys = keys
        self._poll = self._up.poll(
            pb.GetMembershipRequest(
                known_generation=known,
                wait_ms=_AGENT_WAIT_MS if known else 0,
                rank_key=keys[0],
                vouched_rank_keys=keys,
            ),
            _AGENT_WAIT_MS / 1000 + _RPC_SLACK_S,
            self._polled,
        )

    def _polled(self, poll) -> None:
        """The agent's poll ended: its answer is the host's, and the next one goes."""
        if poll is not self._poll:
            return
        self._poll = None
        if self._stopped:
            return
        if poll.cancelled():  # the ranks it vouches for changed: ask again, naming them
            self._repoll()
            return
        try:
            reply = poll.result()
        except grpc.RpcError as exc:
            refused = exc.code() in REFUSED
            self._membership_error = exc if refused else None
            if refused:
                self._seen = True
                self._publish()
            else:
                log.debug("%s host agent: membership poll failed: %s", self.site, exc)
            self._pace()
            return
        if reply.generation != self._known or reply.sites:
            if not reply.sites and reply.generation == self._membership.generation:
                reply.sites.extend(self._membership.sites)
            self._membership = reply
        else:
            del self._membership.suspects[:]
            self._membership.suspects.extend(reply.suspects)
        self._membership_error = None
        self._seen = True
        self._publish()
        self._known = reply.generation
        if reply.suspects or not self._known:
            self._pace()  # answered at once and would be again: pace it
        else:
            self._repoll()

    def _pace(self) -> None:
        def resume() -> None:
            self._pacing = None
            self._repoll()

        self._pacing = self._loop.call_later(_PACE_S, resume)
