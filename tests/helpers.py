"""What tests of every layer share: the real `isthmus` CLI run to completion, ports and
processes, one-line errors, sound protobuf requests, a fake checkpoint, the repository."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isthmus.inter.security import SiteSecurity
    from isthmus.sim.transparent import TransparentWan

ISTHMUS = [sys.executable, "-m", "isthmus.deploy.cli"]
ROOT = Path(__file__).resolve().parents[1]  # the repository: tests/ sits at its top


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the scripts are no package), to call its
    functions in-process. Their folder goes on sys.path, as when one runs: they import
    each other and benchmarks/_common.py by name."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python3 benchmarks/<name>.py ARGS...` run to completion, its output captured."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def run_cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run `isthmus ARGS...` to completion, capturing text output.

    A run past ``timeout`` is a hang to be read, not just a number: every process of
    the job gets SIGUSR1 (each prints all its threads' stacks: the launcher to its
    stderr, ranks to their logs), then SIGKILL, and the raised TimeoutExpired carries
    the launcher's stderr and the tails of the run's logs.
    """
    process = subprocess.Popen(
        [*ISTHMUS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # one process group: the launcher and its ranks
        **kwargs,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGUSR1)
        time.sleep(3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(
            process.args, timeout, output=stdout, stderr=_hang_report(args, stderr)
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def start_coordinator(*args: str) -> tuple[subprocess.Popen, str]:
    """`isthmus coordinator ARGS...` in the background, once it listens: the process
    (the caller ends it) and the address it printed."""
    process = subprocess.Popen(
        [*ISTHMUS, "coordinator", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline()
        assert "listening on" in line, line + process.stderr.read()
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    return process, line.split()[-1]


def start_wan_up(topology: str | Path, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """`isthmus wan up TOPOLOGY --control 127.0.0.1:0 ARGS...` in the background, once
    ready: the process (the caller ends it) and the lines it printed, stripped."""
    command = [sys.executable, "-m", "isthmus.deploy.commands.wan", "up", str(topology)]
    process = subprocess.Popen(
        [*command, "--control", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        while not lines or not lines[-1].startswith("ready"):
            line = process.stdout.readline()
            assert line, process.stderr.read()
            lines.append(line.strip())
    except BaseException:
        process.kill()
        process.wait(10)
        raise
    return process, lines


def _hang_report(args: tuple[str, ...], stderr: str) -> str:
    parts = [f"--- launcher stderr ---\n{stderr[-20000:]}"]
    if "--run-dir" in args:
        logs = Path(args[args.index("--run-dir") + 1]) / "logs"
        for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-20000:]}")
    report = "\n".join(parts)
    print(report, file=sys.stderr)  # pytest shows it with the failure
    return report


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Polls ``condition`` until it holds; fails with ``what`` after ``timeout_s``. The
    way a test waits for something another thread or process does: on the event
    itself, never a fixed delay (a fixed delay is too short on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} (not within {timeout_s:g}s)"
        time.sleep(0.01)


def in_threads(
    target: Callable[[Any], object], items: Iterable, timeout_s: float | None = None,
    daemon: bool = False,
) -> list[threading.Thread]:  # fmt: skip
    """Calls ``target(item)`` for every one of ``items`` at once, each on its own thread,
    and joins each for up to ``timeout_s``; the threads, to see which still run."""
    threads = [threading.Thread(target=target, args=(item,), daemon=daemon) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return threads


@contextlib.contextmanager
def root_wan(prefix: str, spec, nodes: list[int], needs: str) -> Iterator[TransparentWan]:
    """Two sites of ``nodes`` nodes each, joined by a TransparentWan of ``spec`` (its
    names begin ``prefix``). Skipped where not root, ``needs`` saying what needs it."""
    from isthmus.sim.netns import require_tools
    from isthmus.sim.transparent import TransparentWan

    if os.geteuid() != 0:
        import pytest

        pytest.skip(f"{needs} need root (CI is root); not root here")
    require_tools()  # as root, a missing ip or iptables is a failure that says which
    with TransparentWan(f"{prefix}{os.getpid() % 100000}", 2, spec, nodes=nodes) as wan:
        yield wan


class ManualClock:
    """A clock a test moves (``advance``) instead of waiting for time to pass; hand it
    as the ``clock`` of a CoordinatorState, Coordinator or WitnessServer."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening_on(port: int) -> set[str]:
    """The local addresses where something listens on TCP ``port`` (/proc/net/tcp{,6}):
    "127.0.0.1", "0.0.0.0", "::", ..."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host, hex_port = local.split(":")
                if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(host)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                address = socket.inet_ntop(family, raw)
                found.add(address.removeprefix("::ffff:"))  # IPv4-mapped: the IPv4 one
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for every practical purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    """A user error: non-zero exit, one 'error:' line naming the problem, no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def raw_chunk(values: int = 10, **overrides: object):
    """A sound one-chunk PushChunksRequest of ``values`` fp32 ones (raw codec); fields
    overridable, the crc32 that of the payload unless given."""
    import torch

    from isthmus.inter.data.codecs.chain import crc32, make_codec
    from isthmus.proto import lane_pb2

    fields: dict[str, object] = dict(
        generation=1,
        step=0,
        group=0,
        kind=lane_pb2.CHUNK_KIND_CONTRIBUTION,
        chunk_index=0,
        num_chunks=1,
        from_site=1,
        total_elements=values,
        num_elements=values,
        codec="raw",
    )
    fields.update(overrides)
    if "payload" not in fields:
        fields["payload"] = bytes(make_codec("raw").encode(torch.ones(values)))
    fields.setdefault("crc32", crc32(fields["payload"]))
    return lane_pb2.PushChunksRequest(**fields)


def register_rank(
    address: str,
    site: str,
    fingerprint: dict[str, str],
    *,
    key: str,
    lane: str = "127.0.0.1:1",
    rank: int = 0,
    world_size: int = 1,
    security: SiteSecurity | None = None,
) -> None:
    """What a rank does first: register its lane and its key at its site's coordinator
    (over ``security``'s channel: its token, its TLS; plaintext without)."""
    from isthmus.inter.control.coordinator_client import CoordinatorClient
    from isthmus.inter.security import INSECURE

    with (security or INSECURE).channel(address) as channel:
        client = CoordinatorClient(channel, rank_key=key)
        where = {"site": site, "rank": rank, "world_size": world_size, "lane_address": lane}
        client.register_rank(**where, fingerprint=fingerprint, timeout_s=5)


def fake_checkpoint(root: Path, step: int, *, manifest: bool = True) -> Path:
    """A committed-looking checkpoint folder of ``step`` under ``root``, without torch.

    Two small files stand in for torch.distributed.checkpoint's; ``manifest`` adds the
    manifest.json that makes the folder complete (sizes and SHA-256 of both files).
    """
    from isthmus.intra import checkpoint

    path = checkpoint.step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m" * 10)
    (path / "__0_0.distcp").write_bytes(b"d" * 100)
    if manifest:
        files = {
            name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for name in (".metadata", "__0_0.distcp")
            if (f := path / name)
        }
        (path / "manifest.json").write_text(
            json.dumps({"format": checkpoint.FORMAT, "next_step": step, "files": files})
        )
    return path


def job_corpus(config):
    """The corpus and split of a job's [data] section, as its ranks load them."""
    from isthmus.intra.corpus.cache import load_corpus

    vocab = config.resolved_model().vocab_size
    return load_corpus(config.data, seq_len=config.train.seq_len, vocab=vocab)
