"""Whether a rank may trust the host agent it was pointed at, and its channel if so.

A rank sends its host agent (inter/control/host_agent.py) its votes and watches with its
rank key, and takes the agent's answers for the coordinator's: whoever serves the socket
named in ``ISTHMUS_HOST_AGENT`` can vote and vouch in the rank's name and answer its
commits and membership questions. The name is a path, and a path belongs to whoever
made it first or can swap it (issue 59: a folder under ``/tmp`` of a predictable name).
So a rank uses an agent only when

1. the process that listens on the socket runs as the rank's own user: the kernel's
   credentials of a connection to it (``SO_PEERCRED``, what the listener was at
   ``listen``), which no file's owner or mode can fake; and
2. no one else can put another socket in its place later, when gRPC dials the path again
   on a reconnect: the socket is the user's, its folder is the user's and writable by no
   one else, and every folder above it is root's or the user's and writable by others
   only if sticky (as ``/tmp``, where no one may rename another's entry). Symbolic links
   on the way count as folders above: root's or the user's.

An agent refused is refused for good: the rank says why in one line and calls its
coordinator itself, which is always correct (an agent is a fast path, never the only
one). An address that is not a Unix socket path is refused: any local user may listen on
a loopback port, or take an abstract socket's name once it is free. Without
``SO_PEERCRED`` (not Linux) the socket file's owner stands for the listener's: ``bind``
made it, in a folder no one else may write.

A socket not there yet (no folder, no socket, or nothing listening) is not refused: the
agent may be starting (its launcher makes the folder before the ranks). :class:`AgentLink`
waits for it in the background for as long as the rank's own start-up may take, the rank
calling the coordinator meanwhile.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import grpc

from isthmus.inter.security import ClosableChannel
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["AgentLink", "AgentNotUp", "AgentRefused", "check_agent_socket"]

log = logging.getLogger("isthmus.coordinator_client")

_PROBE_TIMEOUT_S = 2.0
"""How long the connection that asks who listens may take (a full backlog blocks it)."""
_FIRST_PAUSE_S, _MAX_PAUSE_S = 0.02, 0.5
"""How often a rank looks for an agent that is not up yet: soon, then twice a second."""
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class AgentRefused(Exception):
    """The agent at this address is not to be trusted; ``str()`` says why."""


class AgentNotUp(Exception):
    """No agent listens at this address yet; ``str()`` says what is missing."""


def _socket_path(address: str) -> Path:
    """The file of a "unix:PATH" or "unix:///PATH" address."""
    if address.startswith("unix://"):
        path = address[len("unix://") :]
    elif address.startswith("unix:"):
        path = address[len("unix:") :]
    else:
        raise AgentRefused(
            f"host agent at {address} is not a Unix socket (who serves it cannot be checked)"
        )
    return Path(os.path.abspath(path))


def _listener_uid(path: Path) -> int | None:
    """The user of the process listening on the socket at ``path``; None when nothing
    does (or it cannot be reached: the checks of the files decide then)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except OSError:  # not there, nothing listening, a full backlog (timed out), ...
            return None
        if not hasattr(socket, "SO_PEERCRED"):
            return os.lstat(path).st_uid  # bind made it as the listener (module docstring)
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid


def _check_folders(address: str, folder: Path, ours: int) -> None:
    """The folder holding the socket, and every one above it, as the module docstring
    says; raises :class:`AgentNotUp` when the folder is not there yet."""
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
            raise AgentRefused(
                f"host agent at {address}: {part} is owned by uid {st.st_uid}, not ours ({ours})"
            )
        if stat.S_ISLNK(st.st_mode):
            continue  # a link's mode means nothing; its folder and its target are checked
        if st.st_mode & _OTHERS_WRITE and (own or not st.st_mode & stat.S_ISVTX):
            raise AgentRefused(
                f"host agent at {address}: {part} is writable by others "
                f"(mode {stat.S_IMODE(st.st_mode):04o})"
            )


def check_agent_socket(address: str) -> None:
    """Checks that the host agent at ``address`` ("unix:PATH") is served by this user and
    cannot be swapped by another (the module docstring says why and how).

    Raises:
        AgentRefused: it is not to be trusted (its message says why, in one line).
        AgentNotUp: the folder or the socket is not there yet, or nothing listens on it.
    """
    path = _socket_path(address)
    ours = os.geteuid()  # the user that SO_PEERCRED reports, and that owns what one makes
    uid = _listener_uid(path)
    if uid is not None and uid != ours:
        raise AgentRefused(f"host agent at {address} is served by uid {uid}, not ours ({ours})")
    _check_folders(address, path.parent, ours)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise AgentNotUp(f"{path} does not exist yet") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise AgentRefused(f"host agent at {address}: {path} is not a socket")
    if st.st_uid != ours:
        raise AgentRefused(
            f"host agent at {address}: {path} is owned by uid {st.st_uid}, not ours ({ours})"
        )
    if uid is None:
        raise AgentNotUp(f"nothing listens on {path}")


class AgentLink:
    """A rank's way to its host agent: a channel once the agent is checked
    (:func:`check_agent_socket`), none while it is not up or after it was refused.

    The agent is checked at once; one not up yet is waited for in the background for
    ``wait_s`` (the rank's own start-up deadline), the rank calling its coordinator
    meanwhile. The rank's log gets at most one line about its agent, the first of:
    refused (why), not up within ``wait_s``, unreachable after it was up
    (:meth:`unreachable`).

    Args:
        address: where the agent listens ("unix:PATH").
        wait_s: how long to wait for an agent that is not up yet; 0: look once.
    """

    def __init__(self, address: str, *, wait_s: float = 0.0) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.CoordinatorStub | None = None
        self._said = False
        self._closed = threading.Event()
        self._waiter: threading.Thread | None = None
        try:
            self._look()
        except AgentNotUp as exc:
            if wait_s <= 0:
                self._say(
                    f"host agent at {address} not up ({exc}): calling the coordinator directly"
                )
                return
            self._waiter = threading.Thread(
                target=self._wait,
                args=(time.monotonic() + wait_s, wait_s),
                name="host-agent-wait",
                daemon=True,
            )
            self._waiter.start()

    @property
    def stub(self) -> pb_grpc.CoordinatorStub | None:
        """The agent's stub once it was checked; None before, or for good if refused."""
        return self._stub

    def _look(self) -> None:
        """Checks the agent once and opens its channel if it passes (a refusal is said
        in the log). Raises :class:`AgentNotUp` when it is not up yet."""
        try:
            check_agent_socket(self.address)
        except AgentRefused as exc:
            self._say(f"{exc}: calling the coordinator directly")
            return
        with self._lock:
            if not self._closed.is_set():
                self._channel = ClosableChannel(grpc.insecure_channel(self.address))
                self._stub = pb_grpc.CoordinatorStub(self._channel)

    def _wait(self, deadline: float, wait_s: float) -> None:
        """Looks for the agent, sooner first, until it is up or refused or ``deadline``."""
        pause = _FIRST_PAUSE_S
        while not self._closed.wait(pause):
            try:
                self._look()
                return
            except AgentNotUp as exc:
                if time.monotonic() >= deadline:
                    self._say(
                        f"host agent at {self.address} not up after {wait_s:g}s, the rank's "
                        f"start-up ({exc}): calling the coordinator directly"
                    )
                    return
            pause = min(2 * pause, _MAX_PAUSE_S, max(deadline - time.monotonic(), 0.0))

    def _say(self, line: str) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        log.warning("%s", line)

    def unreachable(self, details: str) -> None:
        """A call to the agent found it unreachable (``UNAVAILABLE``): the caller makes it
        at the coordinator; the first time, the rank's log says so."""
        self._say(f"host agent at {self.address} unreachable ({details}): calling the coordinator")

    def close(self) -> None:
        """Stops waiting and closes the channel (calls in flight are cancelled)."""
        self._closed.set()
        if self._waiter is not None and self._waiter is not threading.current_thread():
            self._waiter.join(_PROBE_TIMEOUT_S + 1)
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()
