"""A round's chunks to one peer on gRPC ``PushChunks`` streams (mutual TLS, or
``transport = "grpc"``), and what happens when a connection under them is lost.

Per round and per connection, one client-streaming ``PushChunks`` call is fed from a
queue, so encoding (the callers) and sending overlap. A stream is acknowledged only as a
whole, at its end, so a connection that the network black-holed (one flow of a long
link, an ECMP path gone) is noticed by the channel's keepalive pings going unanswered
(``chunk_checks.stream_keepalive``): gRPC then fails every stream on it UNAVAILABLE and
dials a new connection. Such a stream is opened again on the new connection with every
frame it carried, first; the receiving lane stores a chunk at most once and
acknowledges an exact copy of one it has (``Mailbox.deposit``), so a frame that did
arrive is not summed twice. The round goes on, counting ``stalls``, instead of failing
at ``sync.timeout_s`` and being retried. (On the bulk port each frame has a deadline of
its own: ``bulk_peer.py``.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from isthmus.inter.data.wire import Frame

log = logging.getLogger(__name__)

__all__ = ["MAX_REOPENS", "PeerRound"]

MAX_REOPENS = 4
"""How often one connection's stream of a round is opened again after its connection
was lost; past it the round fails (a link that keeps losing connections is down)."""

_POLL_S = 0.1  # how often a waiting stream looks at its call and deadline
_END = object()  # end-of-stream marker


class _Stream:
    """One round's ``PushChunks`` call on one connection, fed from a queue.

    grpcio pulls the request iterator on a thread of its own, so encoding (the
    callers of :meth:`put`) and sending overlap with no sender thread of ours, and
    several rounds' streams share a connection as HTTP/2 streams. Every frame put is
    kept (``frames``) until the round ends: a stream opened again sends them all.
    """

    def __init__(
        self,
        call: grpc.StreamUnaryMultiCallable,
        deadline: float,
        metadata: tuple = (),
        wait_for_ready: bool = True,
    ) -> None:
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._deadline = deadline
        self.frames: list[Frame] = []
        self.closed = False
        # wait_for_ready: a peer still starting is waited for, up to the deadline.
        self.future = call.future(
            self._frames(),
            timeout=max(0.001, deadline - time.monotonic()),
            wait_for_ready=wait_for_ready,
            metadata=metadata or None,
        )

    def put(self, frame: Frame) -> None:
        with self._cond:
            self.frames.append(frame)
            self._items.append(frame)
            self._cond.notify()

    def close(self) -> None:
        """Ends the stream once queued frames are out."""
        with self._cond:
            self.closed = True
            self._items.append(_END)
            self._cond.notify()

    def _frames(self) -> Iterator[bytes]:
        while True:
            with self._cond:
                while not self._items:
                    left = self._deadline - time.monotonic()
                    if left <= 0 or self.future_done():
                        return  # the call's own deadline fails it; nothing more to send
                    self._cond.wait(min(_POLL_S, left))
                item = self._items.popleft()
            if item is _END:
                return
            yield item.joined()  # the payload's one copy, on gRPC's sending thread

    def future_done(self) -> bool:
        fut = getattr(self, "future", None)
        return fut is not None and fut.done()

    def lost_connection(self) -> bool:
        """Whether the call failed because its connection was lost (UNAVAILABLE: a
        keepalive ping unanswered, a reset); not a refusal or the round's deadline."""
        if not self.future_done() or self.future.cancelled():
            return False
        exc = self.future.exception()
        return isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE


class PeerRound:
    """The chunks sent to one peer in one round, spread over the peer's connections.

    Each connection gets its own stream for the round, opened with the first chunk
    for it; rounds are independent, so several can be in flight at once. A stream
    whose connection was lost is opened again (module docstring), up to
    :data:`MAX_REOPENS` times a connection.
    """

    def __init__(
        self,
        calls: list[grpc.StreamUnaryMultiCallable],
        deadline: float,
        metadata: Callable[[float], tuple] | None = None,
        name: str = "peer",
    ) -> None:
        self._calls = calls
        self._deadline = deadline
        self._metadata = metadata  # the stream's pass, without TLS (LanePeer._pass)
        self._name = name
        self._streams: list[_Stream | None] = [None] * len(calls)
        self._reopens = [0] * len(calls)
        self._next = 0
        self._ended = False
        self._lock = threading.Lock()  # encode/decode pool threads send concurrently
        self.sent = 0
        self.resent = 0
        """Always 0 here: a damaged chunk is pulled again by the receiver instead."""
        self.stalls = 0
        """Streams opened again because their connection was lost."""

    def _open_locked(self, i: int, wait_for_ready: bool = True) -> _Stream:
        metadata = self._metadata(self._deadline) if self._metadata else ()
        stream = _Stream(self._calls[i], self._deadline, metadata, wait_for_ready)
        self._streams[i] = stream
        return stream

    def send(self, frame: Frame) -> None:
        """Queues one chunk (joined on gRPC's thread as it goes out); connections take
        turns. Thread-safe.

        A chunk sent after :meth:`end` (a failing round's stragglers) is dropped.
        """
        with self._lock:
            if self._ended:
                return
            i = self._next
            self._next = (i + 1) % len(self._calls)
            self.sent += 1
            stream = self._streams[i] or self._open_locked(i)
            stream.put(frame)  # under the lock: a stream opened again takes every frame

    def end(self) -> None:
        """Closes the round's streams once queued chunks are out (idempotent)."""
        with self._lock:
            ended, self._ended = self._ended, True
            streams = list(self._streams)
        if not ended:
            for stream in streams:
                if stream is not None:
                    stream.close()

    def _current(self) -> list[_Stream]:
        """The round's streams, each whose connection was lost opened again first."""
        with self._lock:
            for i, stream in enumerate(self._streams):
                if stream is None or not stream.lost_connection():
                    continue
                if self._reopens[i] >= MAX_REOPENS or time.monotonic() >= self._deadline:
                    continue  # its error stands: the round fails
                self._reopens[i] += 1
                self.stalls += 1
                # Not waiting for ready: a peer that went away fails it at once (its
                # connection refused), not at the round's deadline; a new connection
                # to a live one is dialled all the same.
                again = self._open_locked(i, wait_for_ready=False)
                for frame in stream.frames:
                    again.put(frame)
                if stream.closed:
                    again.close()
                log.warning(
                    "%s connection %d: lost (%s); its stream of %d chunk(s) goes again",
                    self._name, i, stream.future.exception().details(),
                    len(stream.frames),
                )  # fmt: skip
            return [s for s in self._streams if s is not None]

    def failure(self) -> BaseException | None:
        """Returns the first stream's error so far, without waiting."""
        for stream in self._current():
            fut = stream.future
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                return fut.exception()
        return None

    def wait(self, timeout: float) -> int:
        """Waits for every stream's answer; returns chunks the peer took.

        A chunk is taken when it was accepted or marked corrupt (the peer pulls
        those again with ``ResendChunk``).

        Raises:
            grpc.RpcError: a stream was refused or failed.
            TimeoutError: no answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        total = 0
        for stream in self._current():
            try:
                reply = stream.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError as exc:
                raise TimeoutError("no answer from the peer in time") from exc
            except grpc.RpcError:
                if stream.lost_connection() and self.failure() is None:
                    raise TimeoutError("a stream goes again on a new connection") from None
                raise
            total += reply.accepted + reply.corrupt
        return total
