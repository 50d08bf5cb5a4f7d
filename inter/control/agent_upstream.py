"""A host agent's calls at its coordinator (inter/control/host_agent.py), awaited on its
event loop.

The agent is handed the channel its launcher made (deploy/launch/ranks.py: TLS and the job
token as the ranks' own). Its calls there are few: a host's ballots once a step, on a
``HostSession`` stream (one per batch in flight), one long poll every few seconds, and
what it passes through (a vote ahead, a first membership). :func:`upstream` gives the
agent one face for them, two ways:

- :class:`LoopUpstream`, when the channel has a ``grpc.aio`` twin (one that
  ``SiteSecurity.channel`` made, as the launcher's is: ``inter/security.py``,
  ``aio_twin``): the calls are coroutines of the agent's own loop, and no thread waits
  on one. A synchronous channel's waits cost the agent a reading thread a stream (which
  wakes ten times a second while it waits, in gRPC's own loop), a sending thread, a
  spinning thread a channel, and a thread switch each way a message: at 8 ranks and 1
  step a second, a quarter of the agent's CPU (docs/benchmarks/control-plane.md, "Real host agents,
  a process each").
- :class:`ThreadUpstream`, for any other channel (a test's plain one): the sessions of
  inter/control/host_session.py on two sending threads, the rest as futures.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
import grpc.aio

from isthmus.inter.control.agent_wire import StatusError
from isthmus.inter.control.host_session import HostSession
from isthmus.inter.security import aio_twin
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["REFUSED", "LoopUpstream", "Outcome", "ThreadUpstream", "upstream"]

REFUSED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
"""Codes that refuse a vote for what it says: a batch refused so is sent ballot by ballot."""
_ELSEWHERE = (
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # no session slot free at the coordinator
    grpc.StatusCode.UNAVAILABLE,  # the stream broke
    grpc.StatusCode.CANCELLED,  # the coordinator stopping
)
"""A session's end that sends its vote by ``CommitHostStep`` instead (HostSession's rule)."""
_SENDERS = 2
"""Threads that send a host's ballots (one batch on each at a time): a step's batch, and
one of a late rank or of the step after it."""

Outcome = pb.Decision | tuple[grpc.StatusCode, str]
"""A rank's answer: the decision, or the status its call ends with."""
STOPPED: tuple[grpc.StatusCode, str] = (grpc.StatusCode.UNAVAILABLE, "host agent stopped")
"""What a rank's vote ends with once the agent stopped (it votes elsewhere)."""


def upstream(channel, loop: asyncio.AbstractEventLoop, *, rpc_slack_s: float):
    """The agent's way to its coordinator on ``channel``: on the loop when it has a
    grpc.aio twin, else by threads. Make it on ``loop`` (a twin's channel binds to it).

    Args:
        rpc_slack_s: how long past a vote's wait its answer may take before its stream
            counts as broken (less than the ranks' own slack: a silent stream is the
            agent's to notice, so a rank hears of it, and votes again, before its deadline).
    """
    twin = aio_twin(channel)
    if twin is not None:
        return LoopUpstream(twin(), rpc_slack_s=rpc_slack_s)
    return ThreadUpstream(channel, loop, rpc_slack_s=rpc_slack_s)


class _Batches:
    """What both ways share: a batch refused for what it says goes ballot by ballot."""

    messages = 0
    """Messages of ballots sent."""
    closed = False

    async def votes(
        self, request, ballots: Sequence[pb.RankBallot], wait_ms: int
    ) -> dict[int, Outcome]:
        """``ballots`` on ``request``'s (step, generation), all in one message (one by one
        if that was refused, so one rank's bad key is its refusal alone): each rank's
        outcome."""
        outcome = await self._vote(request, ballots, wait_ms)
        if isinstance(outcome, tuple) and outcome[0] in REFUSED and len(ballots) > 1:
            return {b.rank: await self._vote(request, [b], wait_ms) for b in ballots}
        return {b.rank: outcome for b in ballots}

    async def _vote(self, request, ballots, wait_ms: int) -> Outcome:
        if self.closed:  # the channel closes next: the rank votes elsewhere
            return STOPPED
        self.messages += 1
        message = pb.CommitHostStepRequest(
            site=request.site,
            step=request.step,
            generation=request.generation,
            ballots=ballots,
            wait_ms=wait_ms,
            sites_known=request.sites_known,
        )
        try:
            return await self._send(message)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        except TimeoutError as exc:  # the session went silent: the rank votes again
            return grpc.StatusCode.DEADLINE_EXCEEDED, f"host agent: {exc}"

    async def _send(self, message: pb.CommitHostStepRequest) -> pb.Decision:
        raise NotImplementedError


class LoopUpstream(_Batches):
    """The agent's calls as coroutines of its loop, on a ``grpc.aio`` channel."""

    def __init__(self, channel: grpc.aio.Channel, *, rpc_slack_s: float) -> None:
        self._channel = channel
        self.stub = pb_grpc.CoordinatorStub(channel)
        self._rpc_slack_s = rpc_slack_s
        self._free: list[_Stream] = []  # one per batch in flight
        self._opened: set[_Stream] = set()

    async def call(self, method: str, request, timeout_s: float | None):
        """``request`` to the coordinator's ``method``; its answer.

        Raises:
            grpc.RpcError: refused, or no answer in time.
        """
        return await getattr(self.stub, method)(request, timeout=timeout_s)

    def poll(self, request: pb.GetMembershipRequest, timeout_s: float, done: Callable) -> Any:
        """The agent's long poll, running; ``done(poll)`` on the loop once it ended. The
        poll has ``cancel()``, ``cancelled()`` and ``result()``."""
        task = asyncio.get_running_loop().create_task(
            self.call("GetMembership", request, timeout_s)
        )
        task.add_done_callback(done)
        return task

    async def _send(self, message: pb.CommitHostStepRequest) -> pb.Decision:
        stream = self._free.pop() if self._free else _Stream(self.stub)
        self._opened.add(stream)
        try:
            answer = await stream.vote(message, message.wait_ms / 1000 + self._rpc_slack_s)
        except BaseException:
            self._opened.discard(stream)
            stream.cancel()
            raise
        if answer is None:  # the stream ended: its vote goes as a call (HostSession's rule)
            self._opened.discard(stream)
            return await self.call(
                "CommitHostStep", message, message.wait_ms / 1000 + self._rpc_slack_s
            )
        if not self.closed:
            self._free.append(stream)
        return answer

    async def aclose(self) -> None:
        """Ends the streams (a vote waiting on one ends now) and the channel."""
        self.closed = True
        for stream in [*self._opened, *self._free]:
            stream.cancel()
        self._opened.clear()
        self._free.clear()
        await self._channel.close()

    def close(self) -> None:
        """Nothing to do off the loop (:meth:`aclose` ends it there)."""
        self.closed = True


class _Stream:
    """One ``HostSession`` of a :class:`LoopUpstream`: a vote at a time, answered in order."""

    def __init__(self, stub: pb_grpc.CoordinatorStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None

    async def vote(self, message: pb.CommitHostStepRequest, timeout_s: float):
        """The decision; None when the stream ended for a reason that sends the vote by a
        call instead (as HostSession's: no session slot, broken, the coordinator stopping).

        Raises:
            grpc.RpcError: the vote was refused (the stream ended with that status).
            TimeoutError: no answer within ``timeout_s`` (the stream is dropped).
        """
        if self._call is None:
            self._call = self._stub.HostSession()
        call = self._call
        try:
            await call.write(message)
            answer = await asyncio.wait_for(call.read(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer on the host session within {timeout_s:.1f}s") from None
        except grpc.aio.AioRpcError as exc:
            answer, code = None, exc.code()
            if code not in _ELSEWHERE:
                raise
        if answer is grpc.aio.EOF or answer is None:
            self._call = None
            code = await call.code()
            if code not in _ELSEWHERE:
                raise StatusError(code, await call.details())
            return None
        return answer

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


class ThreadUpstream(_Batches):
    """The agent's calls on a synchronous channel: futures, and sessions on threads."""

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

    def _soon(self, callback: Callable[..., object], *args: object) -> None:
        """``callback(*args)`` on the loop, from any thread (none once it closed)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: the agent stopped
            self._loop.call_soon_threadsafe(callback, *args)

    async def _answer(self, call: grpc.Future):
        done = self._loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        call.add_done_callback(lambda _: self._soon(settle))
        try:
            await done
        except asyncio.CancelledError:
            call.cancel()  # the rank's call that waits on it ended
            raise
        return call.result()

    async def call(self, method: str, request, timeout_s: float | None):
        """As :meth:`LoopUpstream.call`."""
        return await self._answer(getattr(self.stub, method).future(request, timeout=timeout_s))

    def poll(self, request: pb.GetMembershipRequest, timeout_s: float, done: Callable) -> Any:
        """As :meth:`LoopUpstream.poll` (a gRPC future)."""
        future = self.stub.GetMembership.future(request, timeout=timeout_s)
        future.add_done_callback(lambda _: self._soon(done, future))
        return future

    async def _send(self, message: pb.CommitHostStepRequest) -> pb.Decision:
        try:
            return await self._loop.run_in_executor(self._senders, self._on_thread, message)
        except RuntimeError:  # the agent stopped: no thread sends any more
            raise StatusError(*STOPPED) from None

    def _on_thread(self, message: pb.CommitHostStepRequest) -> pb.Decision:
        with self._lock:
            session = self._free.pop() if self._free else None
            if session is None:
                session = HostSession(self.stub, rpc_slack_s=self._rpc_slack_s)
                self._opened.append(session)
        try:
            return session.vote(message)
        finally:
            with self._lock:
                kept = not self.closed
                if kept:
                    self._free.append(session)
            if not kept:
                session.close()

    async def aclose(self) -> None:
        """Nothing left on the loop (:meth:`close` ended the streams)."""

    def close(self) -> None:
        """Ends the streams (a vote waiting on one ends now, CANCELLED) and the threads."""
        with self._lock:
            self.closed = True
            sessions, self._free, self._opened = self._opened, [], []
        for session in sessions:
            session.close()
        self._senders.shutdown(wait=False, cancel_futures=True)
