"""The thread that moves one link direction's bytes: from senders, through a delay line,
to receivers, each piece released at its time from a precise clock.

One `Pump` per `DirectionPipe`, serving every connection that crosses the direction
(its bandwidth is shared, so one thread keeps its clock). Per connection a stream
(`sim/stream.py`): read a piece from the sender once the link admits it (the in-flight
bound; a per-flow cap's token bucket too), ask the pipe for its times (serialization,
latency, impairments), hold it, write it to the receiver when due. Waiting is a `poll`
over the sockets, a wake-up eventfd and a timerfd armed at the next release
(`sim/clock.py`), not an event loop's millisecond ticks.

The bytes stay in the kernel: `os.splice` moves them from the sender's socket into a
chain of pipes (the delay line; one pipe holds a few MiB at most) and on to the
receiver's socket, unless an impairment must read or change them (corruption), in which
case that direction reads them into Python; both kinds may alternate on one stream,
their order kept.

Threads, not processes: `splice`, `poll` and `send` release the GIL and the Python
work is a few microseconds per piece of up to 1 MiB, so the two pumps of a link, its
listeners and the control endpoint share one process without waiting on each other."""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

from .clock import Timer, precise_thread
from .stream import Chunk, Connection, KernelPipe, Stream, arrival, unread

if TYPE_CHECKING:
    from .link import DirectionPipe

__all__ = ["RECV_WINDOW_BYTES", "Connection", "Pump"]

POOL_PIPES = 32  # empty pipes a pump keeps for reuse
INTAKE_PIECES = 4  # most pieces read from one sender per wake-up
RECV_WINDOW_BYTES = 256 * 1024
"""Bytes per connection that may have crossed the link but wait for a slow receiver: like
a TCP receive window, it lets a stalled receiver or stream (a loss, a flap, a `flow_stall`)
hold its own data, not the link's shared in-flight budget (freed as bytes leave the wire)."""
_SPLICE = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE
_IN, _OUT = select.POLLIN | select.POLLHUP | select.POLLERR, select.POLLOUT
_JOIN_S = 10.0


class Pump:
    """Moves one direction's bytes on a thread of its own, started by the first `add`."""

    def __init__(self, pipe: DirectionPipe) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()
        self._incoming: list[tuple[Connection, socket.socket, socket.socket, bytes]] = []
        self._thread: threading.Thread | None = None
        self._closed = self._reset_all = False
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool: list[KernelPipe] = []
        self._flows = 0  # streams taken on so far: the next one's `Stream.flow`

    def add(self, conn: Connection, src: socket.socket, dst: socket.socket, first: bytes) -> None:
        """Carry `src` -> `dst` (both non-blocking) until EOF or failure."""
        with self._lock:
            closed = self._closed
            if not closed:
                conn.attach(self)
                self._incoming.append((conn, src, dst, first))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name=f"isthmus-pump-{self._pipe.name}", daemon=True
                    )
                    self._thread.start()
        if closed:
            conn.fail()
            conn.release()
            return
        self.wake()

    def wake(self) -> None:
        """Make the thread look at its streams and the spec now."""
        with contextlib.suppress(OSError):  # closed: nothing to wake
            os.eventfd_write(self._wake_fd, 1)

    def reset_all(self) -> None:
        with self._lock:
            self._reset_all = True
        self.wake()

    def close(self) -> None:
        """Stop the thread; close the connections it carries (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self.wake()
        if thread is not None:
            thread.join(_JOIN_S)
        for pipe in self._pool:
            pipe.close()
        self._pool.clear()
        os.close(self._wake_fd)

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        precise_thread()
        timer = Timer()
        poller = select.poll()
        poller.register(self._wake_fd, select.POLLIN)
        if timer.fd is not None:
            poller.register(timer.fd, select.POLLIN)
        streams: list[Stream] = []
        by_fd: dict[int, tuple[Stream, int]] = {}  # fd -> (stream, 0 = its src, 1 = dst)
        events: list[tuple[int, int]] = []
        try:
            while True:
                with self._lock:
                    incoming, self._incoming = self._incoming, []
                    closing, reset, self._reset_all = self._closed, self._reset_all, False
                if closing:
                    for conn, *_ in incoming:
                        conn.release()
                    break
                now = time.monotonic()
                self._accept(incoming, streams, by_fd, now)
                self._note_events(events, timer, by_fd)
                next_reset = self._reset_and_read(streams, reset, now)
                now = time.monotonic()
                wake_at, precise = self._deliver_all(streams, now)
                self._retire(streams, poller, by_fd)
                wake_at, precise = self._listen(poller, streams, now, wake_at, precise)
                if next_reset is not None and next_reset < wake_at:
                    wake_at, precise = next_reset, False
                events = timer.wait(poller, wake_at, precise)
        finally:
            for s in streams:
                self._drop(s, poller, by_fd)
            timer.close()

    def _accept(self, incoming: list, streams: list[Stream], by_fd: dict, now: float) -> None:
        """Start a stream for each new connection, numbered in the order they came
        (`Stream.flow`, the one place flows are numbered); admit the bytes already read."""
        for conn, src, dst, first in incoming:
            s = Stream(conn, src, dst, self._flows)
            self._flows += 1
            streams.append(s)
            by_fd[s.sfd], by_fd[s.dfd] = (s, 0), (s, 1)
            if first:
                self._admit(s, first, None, len(first), now)

    def _note_events(self, events: list[tuple[int, int]], timer: Timer, by_fd: dict) -> None:
        """Clear the wake-up and timer fds; mark the streams whose sockets are ready."""
        for fd, _ in events:
            if fd == self._wake_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)
            elif fd == timer.fd:
                timer.clear()
            elif fd in by_fd:
                s, side = by_fd[fd]
                if side == 0:
                    s.readable = True
                else:
                    s.blocked_out = False

    def _reset_and_read(self, streams: list[Stream], reset: bool, now: float) -> float | None:
        """Reset every stream if asked to or a reset is due, then read from each sender
        that has bytes and may send; returns when the next scheduled reset is due."""
        pipe = self._pipe
        due_reset, next_reset = pipe.due_reset(now)
        if reset or due_reset:
            for s in streams:
                if not s.conn.failed:
                    pipe.count("resets")
                    s.conn.fail()
        capped = pipe.spec.flow_capped
        for s in streams:
            # A flow held by its cap stays readable: read it when it may.
            if s.readable and not s.conn.failed and not (capped and s.flow_free > now):
                s.readable = False
                self._intake(s, now)
        return next_reset

    def _deliver_all(self, streams: list[Stream], now: float) -> tuple[float, bool]:
        """Write what is due on every stream; returns (when the next piece is due,
        whether to release it precisely)."""
        wake_at, precise = math.inf, False
        for s in streams:
            if not s.blocked_out and not s.conn.failed:
                due = self._deliver(s, now)
                if due < wake_at:
                    # A stream holding one piece waits on it (a request, a ping): release
                    # it to the microsecond. One holding many is a bulk flow.
                    wake_at, precise = due, len(s.chunks) == 1
        return wake_at, precise

    def _retire(self, streams: list[Stream], poller: select.poll, by_fd: dict) -> None:
        """Drop the finished and failed streams; rotate the rest (who reads first)."""
        for s in [s for s in streams if s.done or s.conn.failed]:
            streams.remove(s)
            self._drop(s, poller, by_fd)
        if streams:
            streams.append(streams.pop(0))  # round robin: who reads first

    def _listen(
        self, poller: select.poll, streams: list[Stream], now: float, wake_at: float, precise: bool
    ) -> tuple[float, bool]:
        """Poll each sender that may send and each receiver that was full; returns
        (wake_at, precise) moved earlier to when link room or a flow's cap comes back."""
        pipe = self._pipe
        room, next_wire = pipe.room(now)
        window = pipe.spec.inflight_limit_bytes + RECV_WINDOW_BYTES
        capped = pipe.spec.flow_capped
        for s in streams:
            reading = not s.eof_read and s.unwritten <= window
            if reading and room == 0 and next_wire is not None and next_wire < wake_at:
                wake_at, precise = next_wire, False  # room comes back then
            if reading and capped and s.flow_free > now:
                reading = False  # its cap holds it: look again when it may send
                if s.flow_free < wake_at:
                    wake_at, precise = s.flow_free, False
            self._register(poller, s, 0, _IN if reading and room > 0 else 0)
            self._register(poller, s, 1, _OUT if s.blocked_out else 0)
        return wake_at, precise

    @staticmethod
    def _register(poller: select.poll, s: Stream, side: int, mask: int) -> None:
        if s.masks[side] == mask:
            return
        fd = s.sfd if side == 0 else s.dfd
        if mask == 0:
            poller.unregister(fd)
        elif s.masks[side] == 0:
            poller.register(fd, mask)
            if side == 0:
                s.listening_since = time.monotonic()
        else:
            poller.modify(fd, mask)
        s.masks[side] = mask

    def _drop(self, s: Stream, poller: select.poll, by_fd: dict) -> None:
        for side in (0, 1):
            self._register(poller, s, side, 0)
        by_fd.pop(s.sfd, None)
        by_fd.pop(s.dfd, None)
        pipes = {id(c.pipe): c.pipe for c in s.chunks if c.pipe is not None}
        if s.tail is not None:
            pipes[id(s.tail)] = s.tail
        for p in pipes.values():
            self._recycle(p)
        s.chunks.clear()
        s.conn.release()

    def _new_pipe(self) -> KernelPipe:
        return self._pool.pop() if self._pool else KernelPipe()

    def _recycle(self, p: KernelPipe) -> None:
        if p.held == 0 and len(self._pool) < POOL_PIPES:
            p.full = False
            self._pool.append(p)
        else:
            p.close()  # holds bytes nobody will read, or the pool is full

    def _intake(self, s: Stream, now: float) -> None:
        """Read pieces from the sender, each as large as the link admits, while it has
        bytes (up to `INTAKE_PIECES`: a fast sender fills a socket buffer faster than
        one poll round trip per piece would empty it)."""
        pipe = self._pipe
        window = pipe.spec.inflight_limit_bytes + RECV_WINDOW_BYTES
        capped = pipe.spec.flow_capped
        for _ in range(INTAKE_PIECES):
            room, _ = pipe.room(now)
            if room <= 0 or s.unwritten > window:
                return
            if capped:
                if s.flow_free > now:
                    s.readable = True  # its cap holds it, not an empty socket
                    return
                room = min(room, pipe.flow_piece_limit())
            data: bytes | None = None
            now = arrival(s, now)
            try:
                if pipe.touches_bytes:
                    data = s.src.recv(room)
                    n = len(data)
                else:
                    n = self._splice_in(s, room)
            except BlockingIOError:
                return
            except OSError:
                s.conn.fail()  # the sender reset: reset the receiver too
                return
            if n < 0:
                return
            if n == 0:
                s.eof_read = True
                s.last = max(pipe.eof(now, s.flow).at, s.last)
                chunk = Chunk(s.last)
                chunk.eof = True
                s.chunks.append(chunk)
                return
            self._admit(s, data, s.tail if data is None else None, n, now)
            if n < room:
                return  # the socket is empty (or the pipe full): poll again
            now = time.monotonic()

    def _splice_in(self, s: Stream, want: int) -> int:
        """Splice up to `want` bytes into the stream's tail pipe; -1 if none waited."""
        if s.tail is None or s.tail.full:
            s.tail = self._new_pipe()
        try:
            n = os.splice(s.sfd, s.tail.w, want, flags=_SPLICE)
        except BlockingIOError:
            if unread(s.sfd) == 0:
                return -1
            # The socket has bytes, so the pipe is full (its slots, not its bytes: a
            # slot holds one socket buffer fragment): go on in a fresh pipe.
            s.tail.full = True
            s.tail = self._new_pipe()
            try:
                n = os.splice(s.sfd, s.tail.w, want, flags=_SPLICE)
            except BlockingIOError:
                return -1
        s.tail.held += n
        return n

    def _admit(
        self, s: Stream, data: bytes | None, held: KernelPipe | None, n: int, now: float
    ) -> None:
        pipe = self._pipe
        s.flow_free = pipe.charge_flow(s.flow_free, n, now)
        piece = pipe.admit(data, n, now, s.flow_free, s.flow)
        s.last = max(piece.at, s.last)
        chunk = Chunk(s.last, n, held)
        if data is not None:
            chunk.data = memoryview(piece.data or b"")
        chunk.slices, chunk.gap, chunk.reset = piece.slices, piece.slice_gap_s, piece.reset
        s.chunks.append(chunk)
        s.unwritten += n

    def _deliver(self, s: Stream, now: float) -> float:
        """Write what is due to the receiver; return when the next piece is due
        (inf: nothing held, or the receiver is full and POLLOUT will tell)."""
        pipe = self._pipe
        while s.chunks:
            c = s.chunks[0]
            if c.due > now:
                return c.due
            if c.eof:
                with contextlib.suppress(OSError):
                    s.dst.shutdown(socket.SHUT_WR)
                s.done = True
                return math.inf
            if c.reset:
                pipe.count("resets")
                s.conn.fail()
                return math.inf
            size = c.left
            if c.slices is not None:
                size = c.slices[c.slice_i]
            try:
                if c.pipe is not None:
                    k = os.splice(c.pipe.r, s.dfd, size, flags=_SPLICE)
                else:
                    assert c.data is not None
                    k = s.dst.send(c.data[c.offset : c.offset + size])
            except BlockingIOError:
                s.blocked_out = True
                return math.inf
            except OSError:
                s.conn.fail()  # the receiver is gone: reset the sender too
                return math.inf
            c.left -= k
            c.offset += k
            s.unwritten -= k
            pipe.bytes_delivered += k
            if c.pipe is not None:
                c.pipe.held -= k
            if c.slices is not None:
                c.slices[c.slice_i] -= k
                if c.slices[c.slice_i] == 0:
                    c.slice_i += 1
                    if c.gap > 0 and c.left:
                        c.due = time.monotonic() + c.gap
                        return c.due
            if c.left == 0:
                s.chunks.popleft()
                if c.pipe is not None and c.pipe.held == 0 and c.pipe is not s.tail:
                    self._recycle(c.pipe)
            elif k < size:
                s.blocked_out = True  # the receiver's buffer is full
                return math.inf
        return math.inf
