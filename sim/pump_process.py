"""One direction of a link pumped in a process of its own (`RelayServer(processes=True)`).

A relay's pump threads share one interpreter lock: a link loaded both ways at once (an
all-reduce) tops out near 34 Gbit/s summed, under the 50 a 25 Gbit/s link carries then
(docs/benchmarks/wan-emulator.md). Here each direction's `DirectionPipe` and `Pump` run
unchanged in a child process, so no two directions share a lock.

The relay still accepts connections and answers CONNECT; it hands each connected pair
to both directions' children as file descriptors (`socket.send_fds`) and closes its own
copies. A direction that fails its connection sets linger 0 and tells the relay, which
fails it in the other direction's child too; the last process to close a copy sends the
RST. What the relay asks of a direction (a new spec, a reset, its counters, close)
travels as a pickled message on the same Unix socket."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from .connect import reset_on_close
from .link import DirectionPipe
from .spec import DirectionSpec
from .stream import Connection

__all__ = ["RemoteDirection"]

_HEAD = struct.Struct("!I")
_MAX_FDS = 2
_REPLY_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 60.0
"""How long the child's first answer may take: a one-time wait for a new interpreter to
start and import the emulator, which took over 10 s on a 2-core machine at load 42 (and
the link failed at `add_link`). Every later answer has `_REPLY_TIMEOUT_S`."""


def _send(sock: socket.socket, message: tuple, fds: list[int] | None = None) -> None:
    body = pickle.dumps(message)
    data = _HEAD.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive(sock: socket.socket) -> tuple[tuple, list[int]] | None:
    """One message and the descriptors that came with it; None at EOF."""
    data, fds, _, _ = socket.recv_fds(sock, _HEAD.size, _MAX_FDS)
    if not data:
        return None
    while len(data) < _HEAD.size:
        more = sock.recv(_HEAD.size - len(data))
        if not more:
            return None
        data += more
    (size,) = _HEAD.unpack(data)
    body = b""
    while len(body) < size:
        more = sock.recv(size - len(body))
        if not more:
            return None
        body += more
    return pickle.loads(body), list(fds)


class RemoteDirection:
    """A `DirectionPipe` whose bytes a child process moves; what `Link` asks of a
    direction, with the same names. ``on_failed`` is called (from a reader thread) with
    a connection the child failed, so that the link fails it in its other direction too."""

    def __init__(
        self, spec: DirectionSpec, name: str, on_failed: Callable[[Connection], None]
    ) -> None:
        self.name = name
        # The parent's own bookkeeping: the spec, the SYN's crossing (`cross`) and the
        # socket buffer size; its pump never starts (nothing is carried here).
        self._local = DirectionPipe(spec, name)
        self._reverse: RemoteDirection | None = None
        self.connections = 0
        self._on_failed = on_failed
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = parent
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(child.fileno()), name], pass_fds=[child.fileno()]
        )
        child.close()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._carried: dict[int, Connection] = {}
        self._ident_of: dict[Connection, int] = {}
        self._replies: dict[int, Any] = {}
        self._replied = threading.Condition()
        self._closed = False
        self._up = False  # the child answered once: it started
        self._reader = threading.Thread(target=self._read, name=f"isthmus-remote-{name}")
        self._reader.daemon = True
        self._reader.start()
        self.update(spec)  # answered: the child is up, no byte waits for it to start

    @property
    def reverse(self) -> RemoteDirection | None:
        return self._reverse

    @reverse.setter
    def reverse(self, other: RemoteDirection | None) -> None:
        self._reverse = other
        self._local.reverse = other._local if other is not None else None

    @property
    def spec(self) -> DirectionSpec:
        return self._local.spec

    def socket_buffer_bytes(self) -> int:
        return self._local.socket_buffer_bytes()

    async def cross(self) -> None:
        await self._local.cross()

    def update(self, spec: DirectionSpec) -> None:
        """New spec for bytes entering after this call (the child's and the parent's)."""
        self._local.update(spec)
        back = self._local.reverse.spec if self._local.reverse is not None else spec
        spec, back = (dataclasses.replace(s, trace=None) for s in (spec, back))  # rows stay here
        self._tell(("update", spec, back))
        if self._reverse is not None:  # its impairments read this direction's latency
            self._reverse._tell(("back", spec))
        # Answered once the child took the spec (it reads its messages in order): bytes
        # sent after this call meet the new spec, and an impairment's at_s counts from
        # before the call returns, as with a thread.
        self._ask("stats")

    def reset_connections(self) -> None:
        self._tell(("reset",))

    def carry(
        self, conn: Connection, src: socket.socket, dst: socket.socket, first: bytes = b""
    ) -> None:
        """Hand the pair to the child, then drop this process's hold on the sockets (the
        other direction does the same; the last closes this process's copies)."""
        ident = next(self._ids)
        self._carried[ident] = conn
        self._ident_of[conn] = ident
        try:
            self._tell(("carry", ident, first), [src.fileno(), dst.fileno()])
        except OSError:
            conn.failed = True
        conn.release()

    def fail(self, conn: Connection) -> None:
        """Fail a connection this direction carries (the other direction failed it)."""
        ident = self._ident_of.pop(conn, None)
        if ident is not None and self._carried.pop(ident, None) is not None:
            with contextlib.suppress(OSError):
                self._tell(("fail", ident))

    def stats(self) -> dict[str, float]:
        """The child's counters, with the connections the relay accepted."""
        stats = self._ask("stats")
        return {**stats, "connections": self.connections}

    def close(self) -> None:
        """Stop the child (its pump closes the connections it carries); idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._tell(("close",))
        try:
            self._process.wait(_REPLY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._sock.close()
        self._local.close()

    def _tell(self, message: tuple, fds: list[int] | None = None) -> None:
        with self._send_lock:
            _send(self._sock, message, fds)

    def _ask(self, what: str) -> Any:
        ident = next(self._ids)
        with self._replied:
            self._tell(("ask", ident, what))
            within_s = _REPLY_TIMEOUT_S if self._up else _START_TIMEOUT_S
            if not self._replied.wait_for(lambda: ident in self._replies, within_s):
                raise RuntimeError(f"direction {self.name}: its pump process did not answer")
            self._up = True
            return self._replies.pop(ident)

    def _read(self) -> None:
        while True:
            try:
                got = _receive(self._sock)
            except OSError:
                got = None
            if got is None:
                return
            (kind, ident, *rest), _ = got
            if kind == "reply":
                with self._replied:
                    self._replies[ident] = rest[0]
                    self._replied.notify_all()
            elif kind in ("failed", "done"):
                conn = self._carried.pop(ident, None)
                if conn is not None:
                    self._ident_of.pop(conn, None)
                    if kind == "failed":
                        self._on_failed(conn)


class _ChildConnection(Connection):
    """A connection as one direction's child holds it: one stream, and a failure
    that the relay must hear of (to fail the other direction)."""

    def __init__(self, a: socket.socket, b: socket.socket, ident: int, tell) -> None:
        super().__init__(a, b)
        self._carriers = 1
        self._ident, self._tell = ident, tell
        self._told = False

    def fail(self, *, quiet: bool = False) -> None:
        for sock in self.socks:  # on the socket itself: the last close sends RST
            reset_on_close(sock)
        if not quiet and not self._told:
            self._told = True
            self._tell(("failed", self._ident))
        super().fail()

    def release(self) -> None:
        if not self.failed:
            self._tell(("done", self._ident))
        super().release()


def _serve(sock: socket.socket, name: str) -> None:
    """The child: a `DirectionPipe` driven by the relay's messages until "close"."""
    pipe: DirectionPipe | None = None
    reverse: DirectionPipe | None = None
    carried: dict[int, _ChildConnection] = {}
    lock = threading.Lock()

    def tell(message: tuple) -> None:
        with lock, contextlib.suppress(OSError):
            _send(sock, message)

    while True:
        got = _receive(sock)
        if got is None:
            break
        message, fds = got
        kind = message[0]
        if kind == "update":
            spec, back = message[1], message[2]
            if pipe is None:
                pipe, reverse = DirectionPipe(spec, name), DirectionPipe(back, name)
                pipe.reverse = reverse
            else:
                assert reverse is not None
                reverse.update(back)
                pipe.update(spec)
        elif kind == "back":
            if reverse is not None:
                reverse.update(message[1])
        elif kind == "carry":
            assert pipe is not None
            ident, first = message[1], message[2]
            src, dst = (socket.socket(fileno=fd) for fd in fds)
            for s in (src, dst):
                s.setblocking(False)
            conn = carried[ident] = _ChildConnection(src, dst, ident, tell)
            pipe.carry(conn, src, dst, first)
        elif kind == "fail":
            failing = carried.pop(message[1], None)
            if failing is not None:
                failing.fail(quiet=True)
        elif kind == "reset":
            if pipe is not None:
                pipe.reset_connections()
        elif kind == "ask":
            stats = pipe.stats() if pipe is not None else {}
            tell(("reply", message[1], stats))
        elif kind == "close":
            break
        for fd in fds if kind != "carry" else ():
            os.close(fd)
        # Forget what ended; a connection that is still carried stays.
        for ident in [i for i, c in carried.items() if c._carriers == 0]:
            del carried[ident]
    if pipe is not None:
        pipe.close()
    sock.close()


_CHILD = (
    "import socket, sys\n"
    "from isthmus.sim.pump_process import _serve\n"
    "_serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2])\n"
)
