"""Whether a rank may trust the host agent it was pointed at, and its connection if so.

Whoever serves the socket named in ``ISTHMUS_HOST_AGENT`` can vote and vouch in the rank's
name and answer its commits and membership questions, and a path belongs to whoever made it
first or can swap it (issue 59: a folder under ``/tmp`` of a predictable name). So a rank
uses an agent only when

1. the process that listens on the socket runs as the rank's own user: the kernel's
   credentials of a connection to it (``SO_PEERCRED``), which no file's owner or mode can
   fake (without ``SO_PEERCRED``, not Linux, the socket file's owner stands for it); and
2. no one else can put another socket in its place: the socket and its folder are the
   user's, the folder writable by no one else, and every folder above it (and every link
   on the way) root's or the user's, writable by others only if sticky (as ``/tmp``).

Every connection a rank opens is checked. An agent refused is refused for good: the rank
says why in one line and calls its coordinator. An address that is not a Unix socket path
is refused: any local user may listen on a loopback port, or take a free abstract name. A
socket not there yet is waited for in the background (:class:`AgentLink`) for as long as
the rank's start-up may take, the rank calling the coordinator meanwhile. Whichever of the
rank's threads waits reads the connection: no thread hand-off.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from isthmus.inter.control import agent_wire
from isthmus.inter.control.agent_wire import FrameError, Frames, Kind, StatusError

__all__ = ["AgentConnection", "AgentLink", "AgentNotUp", "AgentRefused", "connect_agent"]

log = logging.getLogger("isthmus.coordinator_client")

_PROBE_TIMEOUT_S = 2.0  # the connection that asks who listens (a full backlog blocks it)
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.02, 0.5  # looking for an agent not up yet: soon, then 2/s
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_SEND_TIMEOUT_S = 5.0  # an agent that leaves no room to send a frame for that long is gone
_REOPEN_S = 0.5  # after the connection broke: how often another is tried
_DIRECTLY = ": calling the coordinator directly"


class AgentRefused(Exception):
    """The agent at this address is not to be trusted; ``str()`` says why."""


class AgentNotUp(Exception):
    """No agent listens at this address yet; ``str()`` says what is missing."""


def _socket_path(address: str) -> Path:
    for scheme in ("unix://", "unix:"):
        if address.startswith(scheme):
            return Path(os.path.abspath(address[len(scheme) :]))
    raise AgentRefused(
        f"host agent at {address} is not a Unix socket (who serves it cannot be checked)"
    )


def _peer_uid(sock: socket.socket, path: Path) -> int:
    """The user of the process at the other end of ``sock`` (module docstring, 1)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return os.lstat(path).st_uid
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _not_ours(address: str, path: Path, uid: int, ours: int) -> AgentRefused:
    return AgentRefused(f"host agent at {address}: {path} is owned by uid {uid}, not ours ({ours})")


def _check_folders(address: str, folder: Path, ours: int) -> None:
    """The socket's folder and every one above it, as the module docstring says."""
    parts = [folder, *folder.parents]
    real = Path(os.path.realpath(folder))
    if real != folder:  # a link on the way: the folders it leads through count too
        parts += [real, *real.parents]
    for part in parts:
        try:
            st = os.lstat(part)
        except FileNotFoundError:
            raise AgentNotUp(f"{part} does not exist yet") from None
        own = part in (folder, real)  # the socket's own folder: ours alone
        if st.st_uid != ours and (own or st.st_uid != 0):
            raise _not_ours(address, part, st.st_uid, ours)
        if stat.S_ISLNK(st.st_mode):
            continue  # a link's mode means nothing; its folder and its target are checked
        if st.st_mode & _OTHERS_WRITE and (own or not st.st_mode & stat.S_ISVTX):
            raise AgentRefused(
                f"host agent at {address}: {part} is writable by others "
                f"(mode {stat.S_IMODE(st.st_mode):04o})"
            )


def connect_agent(address: str) -> AgentConnection:
    """A connection to the host agent at ``address`` ("unix:PATH"), once it is checked as
    the module docstring says (nothing is sent on it before). Raises :class:`AgentRefused`
    (why, in one line) or :class:`AgentNotUp` (not there yet, or nothing listens)."""
    path = _socket_path(address)
    ours = os.geteuid()  # the user that SO_PEERCRED reports, and that owns what one makes
    try:
        connection: AgentConnection | None = AgentConnection(path)  # checks its listener
    except OSError:  # not there, nothing listening, a full backlog (timed out), ...
        connection = None
    try:
        _check_folders(address, path.parent, ours)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise AgentNotUp(f"{path} does not exist yet") from None
        if not stat.S_ISSOCK(st.st_mode):
            raise AgentRefused(f"host agent at {address}: {path} is not a socket")
        if st.st_uid != ours:
            raise _not_ours(address, path, st.st_uid, ours)
    except BaseException:
        if connection is not None:
            connection.close()
        raise
    if connection is None:
        raise AgentNotUp(f"nothing listens on {path}")
    return connection


class _Request:
    """One request of a rank in flight: its answer once read, and a way to end it."""

    def __init__(self, connection: AgentConnection, rid: int) -> None:
        self._connection, self.rid = connection, rid
        self.answer: tuple[int, bytes] | None = None
        self.cancelled = False

    def cancel(self) -> bool:
        """Ends the request now (a watch: the agent answers it CANCELLED at once)."""
        if self.answer is None and not self.cancelled:
            self.cancelled = True
            # A broken connection: the waiting thread hears that.
            with contextlib.suppress(StatusError):
                self._connection.send(Kind.CANCEL, b"", rid=self.rid)
        return True


class AgentConnection:
    """A rank's one connection to its agent, checked to be served by the rank's own user
    (``SO_PEERCRED`` of this very connection): frames of inter/control/agent_wire.py.

    Any number of threads may :meth:`call` at once: the one that finds no other reading
    reads, and hands the others their answers. :meth:`send` and :meth:`receive` serve an
    event loop (a benchmark's many simulated ranks in one process).
    """

    def __init__(self, path: Path) -> None:
        address = f"unix:{path}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_PROBE_TIMEOUT_S)
            sock.connect(str(path))
            uid, ours = _peer_uid(sock, path), os.geteuid()
            if uid != ours:
                raise AgentRefused(
                    f"host agent at {address} is served by uid {uid}, not ours ({ours})"
                )
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._frames = Frames()
        self._ids = itertools.count(1)
        self._sending = threading.Lock()
        self._room = select.poll()  # used under _sending only
        self._room.register(sock, select.POLLOUT)
        self._readable = select.poll()  # used by the one reading thread only
        self._readable.register(sock, select.POLLIN)
        self._cond = threading.Condition(threading.Lock())
        self._waiting: dict[int, _Request] = {}
        self._reading = False
        self.broken = ""  # why the connection is no more ("" while it is open)

    def fileno(self) -> int:
        return self._sock.fileno()

    def _next_id(self) -> int:
        return next(self._ids) & 0xFFFFFFFF or next(self._ids)

    def send(self, kind: Kind, payload: bytes, *, rid: int = 0) -> int:
        """Sends one frame (a new request id unless ``rid``); returns its id. Raises
        ``StatusError`` UNAVAILABLE when the connection is broken."""
        rid = rid or self._next_id()
        data = memoryview(agent_wire.frame(kind, rid, payload))
        with self._sending:
            while data and not self.broken:
                try:
                    data = data[self._sock.send(data) :]
                except BlockingIOError:
                    if not self._room.poll(_SEND_TIMEOUT_S * 1000):
                        self._break(f"no room to send for {_SEND_TIMEOUT_S:g}s")
                except OSError as exc:
                    self._break(str(exc))
        if self.broken:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, self.broken)
        return rid

    def receive(self) -> list[tuple[int, int, bytes]]:
        """The frames whole now, without waiting: (kind, request id, payload); none once
        the connection is broken (:attr:`broken` says why)."""
        try:
            data = self._sock.recv(1 << 18)
        except BlockingIOError:
            return []
        except OSError as exc:
            data, why = b"", str(exc)
        else:
            why = "the agent closed the connection"
        if not data:
            partial = self._frames.partial
            self._break(why + (f" ({partial} bytes of a frame unread)" if partial else ""))
            return []
        try:
            return self._frames.feed(data)
        except FrameError as exc:
            self._break(str(exc))
            return []

    def call(
        self,
        kind: Kind,
        payload: bytes,
        timeout_s: float,
        on_call: Callable[[_Request], None] | None = None,
    ) -> tuple[int, bytes]:
        """Sends a request and waits for its answer: (kind, payload), never an ERROR (the
        agent's refusal raises ``StatusError``, as do a deadline and a broken connection).
        ``on_call`` is handed the request first: its ``cancel()`` ends it at once, and
        this raises ``grpc.FutureCancelledError``."""
        deadline = time.monotonic() + timeout_s
        request = _Request(self, 0)
        with self._cond:
            request.rid = self._next_id()
            self._waiting[request.rid] = request
        try:
            self.send(kind, payload, rid=request.rid)
            if on_call is not None:
                on_call(request)
            self._wait(request, deadline)
        except StatusError:
            if request.cancelled:
                raise grpc.FutureCancelledError() from None
            raise
        finally:
            with self._cond:
                self._waiting.pop(request.rid, None)
        assert request.answer is not None
        answer_kind, answer = request.answer
        if answer_kind == Kind.ERROR:
            if request.cancelled:
                raise grpc.FutureCancelledError()
            raise agent_wire.status_error(answer)
        return answer_kind, answer

    def _wait(self, request: _Request, deadline: float) -> None:
        with self._cond:
            while request.answer is None:
                if self.broken:
                    raise StatusError(grpc.StatusCode.UNAVAILABLE, self.broken)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "the host agent's answer")
                if self._reading:  # another thread reads: it hands this one its answer
                    self._cond.wait(left)
                    continue
                self._reading = True
                self._cond.release()
                try:
                    frames = self.receive() if self._readable.poll(left * 1000) else []
                finally:
                    self._cond.acquire()
                    self._reading = False
                for kind, rid, payload in frames:
                    waiting = self._waiting.get(rid)
                    if waiting is not None:  # else answered after its caller gave up
                        waiting.answer = (kind, payload)
                self._cond.notify_all()

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why or "broken"

    def close(self) -> None:  # the agent forgets this rank at once
        self._break("closed")
        with contextlib.suppress(OSError):  # shutdown wakes a thread waiting to read
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class AgentLink:
    """A rank's way to its host agent: a connection once the agent is checked
    (:func:`connect_agent`), none while it is not up or after it was refused.

    One not up yet is waited for in the background for ``wait_s`` (the rank's start-up
    deadline); a connection that broke is opened (and checked) again at most every half
    second. The rank's log gets one line about its agent at most, the first of: refused
    (why), not up within ``wait_s`` (0: look once), unreachable after it was up.
    """

    def __init__(self, address: str, *, wait_s: float = 0.0) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._connection: AgentConnection | None = None
        self._checked = False  # the agent was checked and taken: it is used from now on
        self._retry_at = 0.0
        self._said = False
        self._closed = threading.Event()
        self._waiter: threading.Thread | None = None
        try:
            self._look()
        except AgentNotUp as exc:
            if wait_s <= 0:
                self._say(f"host agent at {address} not up ({exc}){_DIRECTLY}")
                return
            args = (time.monotonic() + wait_s, wait_s)
            self._waiter = threading.Thread(
                target=self._wait, args=args, name="host-agent-wait", daemon=True
            )
            self._waiter.start()

    @property
    def checked(self) -> bool:  # the agent was checked and taken (for good)
        return self._checked

    def connection(self) -> AgentConnection | None:
        """The connection to the agent; None when it was never checked, or refused.
        Raises ``StatusError`` UNAVAILABLE when it was up and cannot be reached now."""
        if not self._checked:
            return None
        with self._lock:
            connection = self._connection
            if connection is not None and not connection.broken:
                return connection
            why = connection.broken if connection is not None else "not connected"
            if self._closed.is_set() or time.monotonic() < self._retry_at:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, why)
            self._retry_at = time.monotonic() + _REOPEN_S
            try:
                self._connection = connect_agent(self.address)
            except (AgentNotUp, AgentRefused, OSError) as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"{why}; again: {exc}") from None
            if connection is not None:
                connection.close()
            return self._connection

    def _look(self) -> None:
        """Checks the agent once and connects if it passes; raises :class:`AgentNotUp`."""
        try:
            connection = connect_agent(self.address)
        except AgentRefused as exc:
            self._say(f"{exc}{_DIRECTLY}")
            return
        with self._lock:
            if self._closed.is_set():
                connection.close()
                return
            self._connection, self._checked = connection, True

    def _wait(self, deadline: float, wait_s: float) -> None:
        """Looks for the agent, sooner first, until it is up or refused or ``deadline``."""
        pause = _FIRST_PAUSE_S
        while not self._closed.wait(pause):
            try:
                self._look()
                return
            except AgentNotUp as exc:
                if time.monotonic() >= deadline:
                    up = f"not up after {wait_s:g}s, the rank's start-up ({exc})"
                    self._say(f"host agent at {self.address} {up}{_DIRECTLY}")
                    return
            pause = min(2 * pause, _MAX_PAUSE_S, max(deadline - time.monotonic(), 0.0))

    def _say(self, line: str) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        log.warning("%s", line)

    def unreachable(self, details: str) -> None:
        """A call to the agent found it unreachable: the caller makes it at the coordinator."""
        self._say(f"host agent at {self.address} unreachable ({details}): calling the coordinator")

    def close(self) -> None:
        """Stops waiting and closes the connection (requests in flight end UNAVAILABLE)."""
        self._closed.set()
        if self._waiter is not None and self._waiter is not threading.current_thread():
            self._waiter.join(_PROBE_TIMEOUT_S + 1)
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
