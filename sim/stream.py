"""What a pump holds per connection: the two sockets (`Connection`), one direction's
delay line (`Stream` of `Chunk`s) and the kernel pipes its spliced bytes wait in.

Used by `isthmus.sim.pump`: the pump thread owns every object here except a
`Connection`, which the two directions' pumps share."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from .connect import close_with_rst

if TYPE_CHECKING:
    from .pump import Pump

__all__ = ["Chunk", "Connection", "KernelPipe", "Stream", "arrival", "unread"]

_F_SETPIPE_SZ = 1031  # linux/fcntl.h
PIPE_BYTES = (16 << 20, 4 << 20, 1 << 20)
"""Pipe sizes tried in turn (a privileged process may pass /proc/sys/fs/pipe-max-size)."""
_SO_TIMESTAMPNS = 35  # asm-generic/socket.h; the cmsg type is the same number
_TIMESPEC = struct.Struct("qq")


class Connection:
    """Two sockets carried across a link, one stream each way; closes them when both
    streams are done, with RST if the connection failed (either side failed, or an
    impairment reset it) and an orderly close otherwise."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.socks = (a, b)
        self.failed = False
        self._lock = threading.Lock()
        self._carriers = 2  # one stream per direction
        self._pumps: list[Pump] = []

    def attach(self, pump: Pump) -> None:
        with self._lock:
            self._pumps.append(pump)

    def fail(self) -> None:
        """Reset both sides: every pump carrying the connection drops it."""
        with self._lock:
            self.failed = True
            pumps = list(self._pumps)
        for pump in pumps:
            pump.wake()

    def release(self) -> None:
        """One direction is done with the sockets; the last one closes them."""
        with self._lock:
            self._carriers -= 1
            if self._carriers != 0:
                return
        for sock in self.socks:
            close_with_rst(sock) if self.failed else sock.close()


class KernelPipe:
    """A kernel pipe holding spliced bytes of one stream, in order."""

    __slots__ = ("r", "w", "held", "full")

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        for size in PIPE_BYTES:
            try:
                fcntl.fcntl(self.w, _F_SETPIPE_SZ, size)
                break
            except OSError:
                continue
        self.held = 0
        self.full = False

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class Chunk:
    """One piece in the delay line: `left` bytes due at `due`, in a pipe or in `data`."""

    __slots__ = (
        "due",
        "left",
        "pipe",
        "data",
        "offset",
        "slices",
        "slice_i",
        "gap",
        "eof",
        "reset",
    )

    def __init__(self, due: float, left: int = 0, pipe: KernelPipe | None = None) -> None:
        self.due = due
        self.left = left
        self.pipe = pipe
        self.data: memoryview | None = None
        self.offset = 0
        self.slices: list[int] | None = None
        self.slice_i = 0
        self.gap = 0.0
        self.eof = False
        self.reset = False


class Stream:
    """One connection's bytes in one direction."""

    __slots__ = (
        "conn", "src", "dst", "sfd", "dfd", "chunks", "tail", "unwritten", "last",
        "eof_read", "done", "readable", "blocked_out", "masks", "listening_since",
        "flow_free", "flow",
    )  # fmt: skip

    def __init__(self, conn: Connection, src: socket.socket, dst: socket.socket, flow: int) -> None:
        self.conn, self.src, self.dst = conn, src, dst
        # The connection's serial on the direction (0, 1, ... in the order the pump
        # took them on); every piece it admits carries it (`Piece.flow`).
        self.flow = flow
        self.sfd, self.dfd = src.fileno(), dst.fileno()
        self.chunks: deque[Chunk] = deque()
        self.tail: KernelPipe | None = None
        self.unwritten = 0  # admitted, not yet written to the receiver
        self.last = 0.0  # arrivals stay in order per connection even if delays drop
        self.eof_read = self.done = self.readable = self.blocked_out = False
        self.masks = [0, 0]  # registered poll events of src, dst
        self.listening_since = 0.0  # when the pump began to wait for src's bytes
        self.flow_free = 0.0  # a per-flow cap's token bucket: may read once now >= this
        with contextlib.suppress(OSError):  # kernel receive times, for arrival
            src.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)


def arrival(s: Stream, now: float) -> float:
    """When the bytes waiting in `s.src` reached the relay: the kernel's receive time of
    the first, but no earlier than the pump began to wait for them, else `now`. The pump
    notices bytes 15-200 us late; counting from `now` added that to every crossing."""
    try:
        _, ancillary, _, _ = s.src.recvmsg(1, 64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return now
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            sec, nsec = _TIMESPEC.unpack(value[: _TIMESPEC.size])
            mono, wall = time.monotonic(), time.time()  # read together: wall -> monotonic
            return min(mono, max(mono - (wall - (sec + nsec * 1e-9)), s.listening_since))
    return now


def unread(fd: int) -> int:
    """Bytes waiting in a socket's receive queue."""
    buf = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    return struct.unpack("i", buf)[0]
