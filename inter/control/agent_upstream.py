"""A host agent's calls at its coordinator (inter/control/host_agent.py), awaited on its
event loop.

The agent is handed the channel its launcher made (deploy/launch/ranks.py: TLS and the job
token as the ranks' own), a synchronous gRPC channel. Its calls there are few: a host's
ballots once a step, on a :class:`HostSession` stream (one per batch in flight, from a
pool of two sending threads, since a synchronous stream blocks its caller), one long poll
every few seconds, and what it passes through (a vote ahead, a first membership) as
futures. Each is awaited on the agent's loop, whose thread never blocks on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

from isthmus.inter.control.host_session import HostSession
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["REFUSED", "Outcome", "Upstream"]

REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
"""Codes that refuse a vote for what it says: a batch refused so is sent ballot by ballot."""
_SENDERS = 2
"""Threads that send a host's ballots (one batch on each at a time): a step's batch, and
one of a late rank or of the step after it."""

Outcome = pb.Decision | tuple[grpc.StatusCode, str]
"""A rank's answer: the decision, or the status its call ends with."""


class Upstream:
    """The agent's side of its coordinator, on ``channel`` (synchronous).

    Args:
        channel: the channel to the site's coordinator.
        loop: the agent's event loop, where every call is awaited.
        rpc_slack_s: how long past a vote's wait its answer may take before its stream
            counts as broken (less than the ranks' own slack: a silent stream is the
            agent's to notice, so a rank hears of it, and votes again, before its deadline).
    """

    def __init__(
        self, channel: grpc.Channel, loop: asyncio.AbstractEventLoop, *, rpc_slack_s: float
    ) -> None:
        self.stub = pb_grpc.CoordinatorStub(channel)
        self._loop = loop
        self._rpc_slack_s = rpc_slack_s
        self._senders = futures.ThreadPoolExecutor(_SENDERS, thread_name_prefix="host-vote")
        self._lock = threading.Lock()  # the sessions, shared by the sending threads
        self._free: list[HostSession] = []  # one per batch in flight
        self._opened: list[HostSession] = []  # every one, for close()
        self._closed = False
        self.messages = 0
        """Messages of ballots sent."""

    def soon(self, callback: Callable[..., object], *args: object) -> None:
        """``callback(*args)`` on the loop, from any thread (none once it closed)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: the agent stopped
            self._loop.call_soon_threadsafe(callback, *args)

    async def answer(self, call: grpc.Future):
        """The answer of ``call`` (a future of the channel), awaited; the call is
        cancelled when the rank's call that waits on it is.

        Raises:
            grpc.RpcError: the coordinator refused it, or it got no answer.
        """
        done = self._loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        call.add_done_callback(lambda _: self.soon(settle))
        try:
            await done
        except asyncio.CancelledError:
            call.cancel()
            raise
        return call.result()

    async def votes(
        self, request, ballots: Sequence[pb.RankBallot], wait_ms: int
    ) -> dict[int, Outcome]:
        """``ballots`` on ``request``'s (step, generation), all in one message (one by one
        if that was refused, so one rank's bad key is its refusal alone): each rank's
        outcome."""
        sent = self._loop.run_in_executor(self._senders, self._send, request, ballots, wait_ms)
        try:
            return await sent
        except RuntimeError:  # the agent stopped: no thread sends any more
            return dict.fromkeys((b.rank for b in ballots), self.stopped())

    def _send(self, request, ballots: Sequence[pb.RankBallot], wait_ms: int) -> dict:
        session = self._session()
        try:
            outcome = self._vote(session, request, ballots, wait_ms)
            if isinstance(outcome, tuple) and outcome[0] in REFUSED and len(ballots) > 1:
                return {b.rank: self._vote(session, request, [b], wait_ms) for b in ballots}
            return {b.rank: outcome for b in ballots}
        finally:
            with self._lock:
                kept = not self._closed
                if kept:
                    self._free.append(session)
            if not kept:
                session.close()

    def _vote(self, session: HostSession, request, ballots, wait_ms: int) -> Outcome:
        with self._lock:
            if self._closed:  # its channel closes next: the rank votes elsewhere
                return self.stopped()
            self.messages += 1
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
            return grpc.StatusCode.DEADLINE_EXCEEDED, f"host agent: {exc}"

    def _session(self) -> HostSession:
        with self._lock:
            if self._free:
                return self._free.pop()
            session = HostSession(self.stub, rpc_slack_s=self._rpc_slack_s)
            if not self._closed:
                self._opened.append(session)
            return session

    @staticmethod
    def stopped() -> tuple[grpc.StatusCode, str]:
        """What a rank's vote ends with once the agent stopped (it votes elsewhere)."""
        return grpc.StatusCode.UNAVAILABLE, "host agent stopped"

    def close(self) -> None:
        """Ends the streams (a vote waiting on one ends now, CANCELLED) and the threads."""
        with self._lock:
            self._closed = True
            sessions, self._free, self._opened = self._opened, [], []
        for session in sessions:
            session.close()
        self._senders.shutdown(wait=False, cancel_futures=True)
