"""Rank processes forked from one warm interpreter, a zygote, instead of each started anew.

A rank's imports (torch, DTensor, gRPC, the training code) cost it ~5 s of CPU on a
2-core machine, once per rank of a launcher. So the first rank a launcher starts starts
a zygote: a fresh interpreter (``python -m isthmus.deploy.launch.zygote``; the launcher's
gRPC threads make forking the launcher unsafe) that imports the rank program once, then
forks one child per rank asked for. A child moves to the rank's folder, takes its
environment, points stdout and stderr at its log and runs ``program.run_as_process``.

Ranks die with their launcher: the zygote asks Linux for SIGKILL when the launcher dies,
and each rank when the zygote dies (PR_SET_PDEATHSIG; ``ISTHMUS_LAUNCHER_PID`` names the
zygote to its ranks). The zygote forks from its one Python thread, waits on requests in
``select`` and reaps its children with ``waitpid`` between them, reporting each exit code
within :data:`REAP_S` as ``Popen.returncode`` would (``-9`` for SIGKILL).

The protocol is JSON lines on the zygote's stdin and stdout. Launcher to zygote:
``{"cwd", "env", "log"}``, one per rank. Zygote to launcher: ``{"ready": pid}`` once its
imports are done, ``{"started": pid}`` per request in order, ``{"exit": pid, "code": n}``
per child. ``ISTHMUS_FORK_RANKS=0`` starts every rank as an interpreter of its own; so
does a launcher whose zygote could not start (it says why, once)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ForkedRank", "Zygote", "ZygoteError", "fork_ranks", "prestart", "shared_zygote"]

log = logging.getLogger(__name__)

FORK_ENV = "ISTHMUS_FORK_RANKS"
"""``0`` starts each rank as an interpreter of its own (the old way)."""
RANK_ENTRY = "isthmus.deploy.rank.program:run_as_process"
"""What a forked rank runs: ``module:function``, the function never returns."""
READY_S = 120.0
"""How long a zygote may take to import what it preloads (~5 s on a 2-core machine)."""
REAP_S = 0.02
"""How often the zygote looks for children that ended, between requests."""
PR_SET_PDEATHSIG = 1


class ZygoteError(RuntimeError):
    """The zygote could not start, or is gone: the caller starts the rank anew instead."""


def fork_ranks() -> bool:
    """Whether ranks are forked from a zygote (``ISTHMUS_FORK_RANKS`` is not ``0``)."""
    return os.environ.get(FORK_ENV, "1").strip() not in ("0", "false", "no", "off")


class ForkedRank:
    """A rank the zygote forked, with the part of ``subprocess.Popen`` the launcher uses.
    The zygote reaps it and says its exit code; until then a signal goes to ``pid``."""

    def __init__(self, pid: int, parent: int) -> None:
        self.pid = pid
        self.parent = parent  # the zygote's pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended_with(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()


class Zygote:
    """The launcher's end of one zygote process (see the module docstring). ``entry``
    (``module:function``), which a child runs, must end the process itself."""

    def __init__(
        self,
        env: Mapping[str, str],
        preload: tuple[str, ...] = ("isthmus.deploy.rank.program",),
        entry: str = RANK_ENTRY,
    ) -> None:
        env = {**env, "ISTHMUS_LAUNCHER_PID": str(os.getpid())}
        self._closed = threading.Event()
        self.process = self._popen_kept(
            [sys.executable, "-m", "isthmus.deploy.launch.zygote", entry, *preload], env
        )
        self._lock = threading.Lock()  # one request, and its reply, at a time
        self._started: queue.Queue[int | None] = queue.Queue()
        self._ranks: dict[int, ForkedRank] = {}
        self._ready = threading.Event()
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        if not self._ready.wait(READY_S) or self._gone:
            self.close()
            raise ZygoteError(
                f"the rank zygote did not start within {READY_S:.0f}s"
                if not self._gone
                else f"the rank zygote exited with code {self.process.wait()} before it was ready"
            )

    def _popen_kept(self, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Starts the zygote from a thread that lives until :meth:`close`: Linux sends
        PR_SET_PDEATHSIG when the *thread* that started a process ends, and the thread
        that happens to start the first rank (a site's, a test's) may end long before
        the ranks of the launcher's other sites do."""
        started: queue.Queue[subprocess.Popen | BaseException] = queue.Queue()

        def keep() -> None:
            try:
                started.put(
                    subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                )
            except BaseException as exc:  # handed to the caller, raised there
                started.put(exc)
                return
            self._closed.wait()

        threading.Thread(target=keep, name="zygote-keeper", daemon=True).start()
        process = started.get()
        if isinstance(process, BaseException):
            raise process
        return process

    @property
    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def start(self, env: Mapping[str, str], log_path: Path, cwd: str | None = None) -> ForkedRank:
        """Forks one rank with environment ``env``, its output in ``log_path`` (made
        anew, as ``open(log_path, "w")`` would), in folder ``cwd`` (this process's)."""
        request = {"cwd": cwd or os.getcwd(), "env": dict(env), "log": str(log_path)}
        with self._lock:
            if not self.alive:
                raise ZygoteError("the rank zygote is gone")
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
            except OSError as exc:
                raise ZygoteError(f"the rank zygote is gone: {exc}") from exc
            pid = self._started.get(timeout=READY_S)
        if pid is None:
            raise ZygoteError("the rank zygote exited before it forked the rank")
        return self._ranks[pid]

    def close(self) -> None:
        """Ends the zygote (the ranks it forked die with it) and waits for it."""
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()  # it exits at the end of its requests
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._closed.set()  # (its keeper thread ends only now: see _popen_kept)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set()
            elif "started" in message:
                pid = int(message["started"])
                self._ranks[pid] = ForkedRank(pid, parent=self.process.pid)
                self._started.put(pid)
            elif "exit" in message:
                rank = self._ranks.get(int(message["exit"]))
                if rank is not None:
                    rank._ended_with(int(message["code"]))
        # The zygote ended: every child it had got SIGKILL from Linux (PR_SET_PDEATHSIG).
        self._gone = True
        self.process.wait()
        for rank in self._ranks.values():
            rank._ended_with(-signal.SIGKILL)
        self._started.put(None)
        self._ready.set()


_shared: Zygote | None = None
_shared_lock = threading.Lock()
_shared_failed = False


def shared_zygote(env: Mapping[str, str]) -> Zygote | None:
    """This launcher's zygote, started on first use with ``env``; None where ranks are
    not forked (``ISTHMUS_FORK_RANKS=0``) or the zygote could not start (said once)."""
    global _shared, _shared_failed
    if not fork_ranks():
        return None
    with _shared_lock:
        if _shared is not None and _shared.alive:
            return _shared
        if _shared_failed:
            return None
        try:
            _shared = Zygote(env)
        except (OSError, ZygoteError) as exc:
            _shared_failed = True
            log.warning("ranks start as interpreters of their own: %s", exc)
            return None
        # Ended and waited for as the launcher exits, rather than killed with it: then
        # its own CPU time and its ranks' count in the launcher's (``time``, rusage).
        atexit.register(_shared.close)
        return _shared


def prestart(threads: int) -> None:
    """Starts this launcher's zygote now, in the background, so that its imports overlap
    the launcher's own work; ``threads``: the ranks' OMP threads, read as libraries load."""
    if fork_ranks():
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        threading.Thread(
            target=shared_zygote, args=(env,), name="zygote-prestart", daemon=True
        ).start()


# -- the zygote process ---------------------------------------------------------------


def _die_with(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took hold
        os._exit(143)


def _child(request: dict, entry, private: tuple[int, ...], parent: int) -> None:
    """In a forked child: become the rank, run it; never returns."""
    code = 1
    try:
        _die_with(parent)  # (a fork does not inherit PR_SET_PDEATHSIG)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        for fd in private:
            os.close(fd)
        os.chdir(request["cwd"])
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        # Where the rank's environment names a PYTHONPATH the zygote's did not, its
        # entries go first, as a fresh interpreter would have put them.
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[1:1] = [p for p in extra if p not in sys.path]
        # The rank dies with its parent, this zygote (rank/program.py asks for it too).
        os.environ["ISTHMUS_LAUNCHER_PID"] = str(parent)
        sys.argv = [getattr(sys.modules[entry.__module__], "__file__", None) or entry.__module__]
        entry()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(reply) -> None:
    """Says the exit code of every child that ended since the last look."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children at all
            return
        if pid == 0:
            return
        reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _serve(entry_name: str, preload: list[str]) -> None:
    _die_with(int(os.environ["ISTHMUS_LAUNCHER_PID"]))
    # Requests and replies on fds of their own; the zygote's fd 0 and 1, which the
    # children inherit until they point them elsewhere, are /dev/null and stderr.
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    # Ctrl-C in a terminal reaches the whole process group: the launcher ends the ranks,
    # and the zygote, whose death would SIGKILL them first, stays out of it; so it does
    # of SIGUSR1, with which a hung job's ranks are asked for their stacks (a child
    # sets both back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    gc.disable()  # (as rank/program.py does while its imports load)
    for module in preload:
        importlib.import_module(module)
    module_name, _, function = entry_name.partition(":")
    entry = getattr(importlib.import_module(module_name), function)
    gc.freeze()  # the imports' objects: out of every child's collections, shared pages
    gc.enable()

    def reply(message: dict) -> None:
        os.write(replies, json.dumps(message).encode() + b"\n")

    zygote = os.getpid()
    reply({"ready": zygote})
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], REAP_S)
        _reap(reply)
        if not readable:
            continue
        data = os.read(requests, 1 << 16)
        if not data:  # the launcher closed us: the children die with this process
            os._exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request, entry, (requests, replies), parent=zygote)
            reply({"started": pid})


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
