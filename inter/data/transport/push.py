"""A round's chunks to one peer as one-chunk gRPC ``PushChunks`` calls (mutual TLS, or
``transport = "grpc"``), each acknowledged and each with a deadline of its own.

A :class:`StreamConnection` is one gRPC channel to a peer's lane, shared by that peer's
rounds. Each chunk is one call (or several of a round queued behind each other, up to
:data:`BATCH_BYTES`), answered when the peer's lane has stored them; up to
:data:`CALLS_PER_CONNECTION` are in flight, the rest queue in order. The oldest call has
a deadline from its size and the connection's measured rate (:class:`.flow_clock.FlowClock`,
the bulk port's rule); a connection that misses one is stalled (a flow black-holed on the
way, a peer that stopped reading while its connection still answers pings): a new channel
takes its place (a new flow), its calls in flight go first on it, and the rounds go on.
A connection lost under its calls (UNAVAILABLE, or CANCELLED by the peer's lane as it
stops) sends them again the same way, without wait-for-ready, so a peer whose lane went
away fails its rounds within a second or so. The receiving lane stores a chunk at most
once (``Mailbox.deposit``), so one that did arrive before its connection was left is not
summed twice.

A chunk's own answer is waited for: streams acknowledged as a whole left a flow that
stalled while carrying little (a small round) unnoticed, its keepalive pings answered.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from isthmus.inter.closable import ClosedChannelError
from isthmus.inter.data.transport.bulk import ACCEPTED
from isthmus.inter.data.transport.chunk_checks import STREAM_WINDOW_BYTES
from isthmus.inter.data.transport.flow_clock import FIRST_RATE_BPS, MAX_LOSSES, FlowClock
from isthmus.inter.data.transport.peer_round import PeerRound
from isthmus.inter.data.transport.wire import Frame
from isthmus.proto import lane_pb2

__all__ = ["CALLS_PER_CONNECTION", "MAX_LOSSES", "StreamConnection"]

log = logging.getLogger(__name__)

PUSH = "/isthmus.v1.Lane/PushChunks"
CALLS_PER_CONNECTION = 2
"""One-chunk calls in flight on one connection at once. A chunk is about one
bandwidth-delay product (chunk_size.py), so two keep the flow busy while an answer comes
back; more would share the connection and end every chunk late."""
BATCH_BYTES = STREAM_WINDOW_BYTES // 2
"""Payload bytes of one call at most when chunks of one round queue behind each other
(16 MiB): fewer calls (each a stream and a thread at both ends), while the peer still
stores each chunk as it arrives; half a stream's window, so a call's bytes are on the
wire before its answer is waited for."""
BUSY_RETRY_S = 0.05
"""How long a chunk the peer had no stream slot for waits before it goes again."""
_BUSY = "PushChunks stream slots"  # in the details of the lane's slot refusal (WaitSlots)


@dataclass(slots=True)
class _Call:
    """A chunk on the wire of a connection, not yet answered."""

    rnd: PeerRound
    frames: list[Frame]
    at: float  # when the call was made (time.monotonic())
    generation: int
    """The connection's generation it went out on (a new one after each stall or loss)."""
    future: grpc.Future | None = None  # held: grpc cancels a call whose future is collected

    @property
    def size(self) -> int:
        return sum(f.payload_bytes + len(f.header) for f in self.frames)


def _joined(frames: list[Frame]) -> Iterator[bytes]:
    for frame in frames:
        yield frame.joined()  # the payload's one copy, on gRPC's sending thread


class StreamConnection:
    """One gRPC connection to a peer's lane carrying one-chunk ``PushChunks`` calls.

    A sender thread makes the calls (a call's pass may take an RPC of its own, which
    must not run on gRPC's callback threads) and watches the oldest one's deadline;
    answers arrive on gRPC's threads. ``renew(old)`` returns a new channel on a new TCP
    connection (the lane peer's, which also makes its other calls on it);
    ``metadata(deadline)`` is the pass a call presents (without TLS: a ticket,
    ``LanePeer._stream_pass``; with TLS, none).
    """

    def __init__(
        self,
        channel: grpc.Channel,
        renew: Callable[[grpc.Channel], grpc.Channel],
        metadata: Callable[[float], tuple],
        name: str,
    ) -> None:
        self._renew, self._metadata, self._name = renew, metadata, name
        self._channel = channel
        self._push = self._callable(channel)
        self._cond = threading.Condition()
        self._queue: deque[tuple[PeerRound, Frame]] = deque()
        self._inflight: dict[int, _Call] = {}  # by key, oldest first
        self._keys = 0
        self._generation = 0
        self._clock = FlowClock()
        self._losses = 0  # losses in a row; an answer puts it back to 0
        self._wait_for_ready = True  # a peer still starting is waited for; not after a loss
        self._not_before = 0.0  # a chunk the peer was too busy for waits until then
        self._closed = False
        self._bytes_put = 0
        self._thread: threading.Thread | None = None

    @staticmethod
    def _callable(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
        # The frames are bytes already (inter/data/transport/wire.py), not protobuf objects.
        answer = lane_pb2.PushChunksResponse.FromString
        return channel.stream_unary(PUSH, request_serializer=None, response_deserializer=answer)

    def put(self, rnd: PeerRound, frame: Frame) -> None:
        """Queues ``frame`` of ``rnd``. Raises ConnectionError once closed."""
        with self._cond:
            if self._closed:
                raise ConnectionError(f"connection {self._name} closed")
            self._queue.append((rnd, frame))
            self._bytes_put += frame.payload_bytes
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"push-{self._name}", daemon=True
                )
                self._thread.start()

    def load(self) -> tuple[int, int]:
        """Payload bytes queued or in calls not yet answered, and payload bytes ever
        queued here (:meth:`PeerRound.send` picks the least loaded)."""
        with self._cond:
            queued = sum(frame.payload_bytes for _, frame in self._queue)
            backlog = queued + sum(
                f.payload_bytes for c in self._inflight.values() for f in c.frames
            )
            return backlog, self._bytes_put

    def close(self) -> None:
        """Stops the sender; calls in flight end with the channel (the lane peer's)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the sender thread ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._next_locked()
                if item is None:
                    return
            if isinstance(item, list):
                self._stalled(item)
            else:
                self._call(*item)

    def _next_locked(self) -> tuple[PeerRound, list[Frame]] | list[_Call] | None:
        """Waits for chunks to call with, or for the oldest call's deadline to pass
        (then the calls in flight, taken out of it); None once closed."""
        while not self._closed:
            now = time.monotonic()
            # No deadline before the connection's first answer: a peer still starting
            # is waited for (wait-for-ready), up to its round's deadline.
            oldest = next(iter(self._inflight.values()), None) if self._clock.last_ack else None
            due = self._clock.due(oldest.at, oldest.size) if oldest else math.inf
            if now >= due:
                return self._take_inflight_locked()
            if self._queue and len(self._inflight) < CALLS_PER_CONNECTION:
                if now >= self._not_before:
                    return self._batch_locked()
                due = min(due, self._not_before)  # in the future: no busy wait
            # Waking at least every half second: cheap, and a missed notify costs little.
            self._cond.wait(min(due - now, 0.5))
        return None

    def _take_inflight_locked(self) -> list[_Call]:
        """The calls in flight, put first in the queue again on a new generation."""
        calls = list(self._inflight.values())
        self._inflight.clear()
        self._queue.extendleft((c.rnd, f) for c in reversed(calls) for f in reversed(c.frames))
        self._generation += 1
        return calls

    def _batch_locked(self) -> tuple[PeerRound, list[Frame]]:
        """The queue's first chunk and those of its round right behind it, up to
        :data:`BATCH_BYTES`, for one call."""
        rnd, frame = self._queue.popleft()
        frames, size = [frame], frame.payload_bytes
        while self._queue and self._queue[0][0] is rnd:
            nxt = self._queue[0][1]
            if size + nxt.payload_bytes > BATCH_BYTES:
                break
            frames.append(self._queue.popleft()[1])
            size += nxt.payload_bytes
        return rnd, frames

    def _call(self, rnd: PeerRound, frames: list[Frame]) -> None:
        if rnd.failure() is not None:
            return  # a failed round's chunks still queued: nobody waits for them
        with self._cond:
            key, self._keys = self._keys, self._keys + 1
            call = _Call(rnd, frames, time.monotonic(), self._generation)
            self._inflight[key] = call  # counted in flight before the call is made
            push, ready = self._push, self._wait_for_ready
        try:
            metadata = self._metadata(rnd.deadline)
            future = push.future(
                _joined(frames),
                timeout=max(0.001, rnd.deadline - time.monotonic()),
                wait_for_ready=ready,
                metadata=metadata or None,
            )
        except grpc.RpcError as exc:  # no pass for the call (the peer refused one)
            with self._cond:
                self._inflight.pop(key, None)
                self._cond.notify_all()
            rnd.failed(exc)
            return
        call.future = future
        future.add_done_callback(functools.partial(self._answered, key))

    def _stalled(self, calls: list[_Call]) -> None:
        """The oldest call missed its deadline: a new channel, the calls in flight
        first on it (queued by :meth:`_take_inflight_locked`); the lane peer closes the
        old one a little later (``LanePeer._renew``)."""
        oldest = calls[0]
        with self._cond:
            began = self._clock.began(oldest.at)
            allowed = self._clock.allowed(oldest.size)
            self._clock.stalled()
            old = self._channel
        log.warning(
            "connection %s stalled: a call of %.2f MB unanswered after %.1fs (its deadline: "
            "%.1fs at %.0f MB/s); its %d chunk(s) in flight go again on a new connection",
            self._name, oldest.size / 1e6, time.monotonic() - began,
            allowed, (self._clock.rate or FIRST_RATE_BPS) / 1e6, len(calls),
        )  # fmt: skip
        self._new_channel(old)
        oldest.rnd.stalled()  # counted once, by the round whose chunk missed it

    def _new_channel(self, old: grpc.Channel) -> None:
        new = self._renew(old)  # the old one's calls end as they may, unheeded
        with self._cond:
            if self._channel is old:
                self._channel, self._push = new, self._callable(new)
            self._cond.notify_all()

    # -- answers (gRPC's threads) --------------------------------------------------

    def _answered(self, key: int, future: grpc.Future) -> None:
        now = time.monotonic()
        with self._cond:
            call = self._inflight.pop(key, None)
            self._cond.notify_all()
            if call is None:
                return  # stalled: it went again on a new connection
            if not future.cancelled() and future.exception() is None:
                self._clock.acknowledged(call.at, call.size, now)
                self._losses, self._wait_for_ready = 0, True
                reply = future.result()
                answer: tuple | None = (ACCEPTED, reply.accepted + reply.corrupt)
            else:
                answer = self._failed_locked(call, future, now)
        if answer is None:
            return
        if isinstance(answer[0], BaseException):
            for rnd in answer[1]:
                rnd.failed(answer[0])
        else:
            call.rnd.acknowledged(*answer)

    def _failed_locked(self, call: _Call, future: grpc.Future, now: float) -> tuple | None:
        """What a failed call means: None when its chunk goes again, else the error and
        the rounds it fails."""
        exc = future.exception() if not future.cancelled() else None
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.CANCELLED
        details = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _BUSY in details:
            self._requeue_locked(call)  # the peer's slots were busy
            self._not_before = now + BUSY_RETRY_S
            return None
        # Lost: the connection broke, or the peer's lane cancelled the call (it is
        # stopping: a lane that went away fails the calls made again at once). A call
        # of this side's own (the peer closed, ClosedChannelError) ends the round.
        lost = code == grpc.StatusCode.UNAVAILABLE or (
            code == grpc.StatusCode.CANCELLED
            and isinstance(exc, grpc.Call)
            and not isinstance(exc, ClosedChannelError)
        )
        if not lost or now >= call.rnd.deadline:
            return exc or grpc.FutureCancelledError(), [call.rnd]
        if call.generation == self._generation:  # the first news of this loss
            self._generation += 1
            self._losses += 1
            self._wait_for_ready = False  # a peer that went away fails the next at once
            self._not_before = now + BUSY_RETRY_S * self._losses
            if self._losses > MAX_LOSSES:
                self._losses = 0  # a later round tries afresh (the peer may be back)
                rounds = {id(c.rnd): c.rnd for c in self._inflight.values()}
                rounds.update((id(r), r) for r, _ in self._queue)
                rounds[id(call.rnd)] = call.rnd
                self._queue = deque(i for i in self._queue if id(i[0]) not in rounds)
                return exc, list(rounds.values())
            log.warning("connection %s lost (%s); its chunks go again", self._name, details)
            call.rnd.stalled()
        self._requeue_locked(call)
        return None

    def _requeue_locked(self, call: _Call) -> None:
        self._queue.extendleft((call.rnd, f) for f in reversed(call.frames))
