"""A host agent's calls at its coordinator (inter/control/host_agent.py), awaited on its
event loop.

The agent is handed the channel its launcher made (deploy/launch/ranks.py: TLS and the job
token as the ranks' own, by ``peer_channel``). Its calls there are few: a host's ballots
once a step, on a ``HostSession`` stream (one per batch in flight), one long poll every few
seconds, and what it passes through (a vote ahead, a first membership). They are
coroutines of the agent's own loop, on the channel's ``grpc.aio`` twin
(``inter/security.py``, ``aio_twin``), and no thread waits on one. A synchronous channel's
waits cost the agent a reading thread a stream (which wakes ten times a second while it
waits, in gRPC's own loop), a sending thread, a spinning thread a channel, and a thread
switch each way a message: at 8 ranks and 1 step a second, a quarter of the agent's CPU
(docs/benchmarks/control-plane.md, "Real host agents, a process each").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from isthmus.inter.control.agent_wire import StatusError
from isthmus.inter.security import aio_twin
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["REFUSED", "LoopUpstream", "Outcome", "upstream"]

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

Outcome = pb.Decision | tuple[grpc.StatusCode, str]
"""A rank's answer: the decision, or the status its call ends with."""
STOPPED: tuple[grpc.StatusCode, str] = (grpc.StatusCode.UNAVAILABLE, "host agent stopped")
"""What a rank's vote ends with once the agent stopped (it votes elsewhere)."""


def upstream(channel: grpc.Channel, *, rpc_slack_s: float) -> LoopUpstream:
    """The agent's way to its coordinator on ``channel``'s grpc.aio twin; make it on the
    agent's loop (the twin's channel binds to it). ``rpc_slack_s``: how long past a vote's
    wait its answer may take before its stream counts as broken (less than the ranks' own
    slack, so a rank hears of a silent stream, and votes again, before its deadline)."""
    twin = aio_twin(channel)
    if twin is None:
        raise ValueError("a host agent's channel is one that peer_channel made (a grpc.aio twin)")
    return LoopUpstream(twin(), rpc_slack_s=rpc_slack_s)


class LoopUpstream:
    """The agent's calls as coroutines of its loop, on a ``grpc.aio`` channel."""

    messages = 0  # of ballots sent
    closed = False

    def __init__(self, channel: grpc.aio.Channel, *, rpc_slack_s: float) -> None:
        self._channel = channel
        self.stub = pb_grpc.CoordinatorStub(channel)
        self._rpc_slack_s = rpc_slack_s
        self._free: list[_Stream] = []  # one per batch in flight
        self._opened: set[_Stream] = set()

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

    async def call(self, method: str, request, timeout_s: float | None):
        """``request`` to the coordinator's ``method``; its answer (or ``grpc.RpcError``)."""
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
        call instead (as HostSession's: no session slot, broken, the coordinator stopping);
        ``grpc.RpcError`` when the vote was refused, ``TimeoutError`` after ``timeout_s``."""
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
