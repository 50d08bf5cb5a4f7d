"""One site's rank processes on this machine, and the run directory they write to.

A site is its own torch.distributed world: one process per rank runs
`isthmus.deploy.rank.program`, and the ranks, all on this host, meet in a FileStore in a
0700 folder the launcher makes and removes (:data:`STORE_ENV`), which only the site's user
can reach; torch's TCPStore has no authentication (issue 33, row 11) and stays only where
a site's ranks span hosts (deploy/slurm/site-multinode.sbatch), behind the cluster's
network. Each rank gets the key its coordinator drew for it (inter/control/rank_keys.py);
their host agent (``run.host_agent``) listens on a socket in the same folder.

A rank is forked from the launcher's zygote, which did the rank's imports once
(deploy/launch/zygote.py; ``ISTHMUS_FORK_RANKS=0`` starts each as an interpreter of its
own). Ranks die with the launcher even if it is killed: the zygote and each rank ask
Linux for PR_SET_PDEATHSIG themselves (a preexec_fn would fork the launcher, whose gRPC
threads make fork unsafe)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from isthmus.deploy.config.job import JobConfig
from isthmus.deploy.launch.zygote import READY_S, ForkedRank, ZygoteError, fork_ranks, shared_zygote
from isthmus.deploy.rank.contract import AGENT_ENV, STORE_ENV
from isthmus.deploy.security.trust import site_security
from isthmus.inter.control.channels import peer_channel
from isthmus.inter.control.host_agent import HostAgent
from isthmus.inter.control.rank_keys import KEY_ENV, handout

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 5.0
AGENT_STOP_SIGNAL = signal.SIGUSR2
"""Stops a launcher's host agent while its ranks run on through the coordinator
(`isthmus chaos`'s agent-kill; an operator who suspects the agent)."""
RANK_ONLY_ENV = frozenset({KEY_ENV, "RANK", "LOCAL_RANK", "ISTHMUS_LAUNCHER_PID"})
"""One rank's environment that its zygote (shared by the launcher's ranks) is not given."""


class LaunchError(RuntimeError):
    """The job failed; the message says where and why, in one line."""


def config_path(run_dir: Path, site: str | None, node: int | None = None) -> Path:
    """Where the ranks read the resolved config: one file per site for `isthmus site`
    (sites may differ in how they reach each other), one per node of a site on several
    (each node advertises its own address), one for the whole local job."""
    if site is None:
        return run_dir / "config.toml"
    return run_dir / (f"config-{site}.toml" if node is None else f"config-{site}-node{node}.toml")


def prepare_run_dir(
    config: JobConfig, site: str | None = None, node: int | None = None
) -> tuple[Path, bool]:
    """Create (or clean) the run directory and write the resolved config into it; returns
    it and whether it is a temporary one the caller removes. With ``site`` only that
    site's files are cleaned (sites started from different shells may share the folder);
    with ``node`` that node's config is written, and only node 0 cleans."""
    if config.run.run_dir:
        run_dir, temporary = Path(config.run.run_dir).resolve(), False
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir, temporary = Path(tempfile.mkdtemp(prefix="isthmus-run-")), True
    stale = (f"sites/{site}",) if site else ("metrics.jsonl", "summary.json", "sites")
    for name in stale if not node else ():
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (run_dir / "logs").mkdir(exist_ok=True)
    config_path(run_dir, site, node).write_text(config.to_toml())
    return run_dir, temporary


FULL_BELOW = 1 << 20
"""A disk with less free space than this could not take a rank's last line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSlice:
    """The ranks of a site that one node starts when the site spans several nodes
    (``isthmus site --nodes N --node-rank K``): they meet the other nodes' ranks in
    torch's env:// rendezvous at ``master``, not in a FileStore of this host."""

    first: int  # the site rank of this node's first rank
    count: int
    master: str  # host:port of the site's rendezvous (its first node)
    keys: tuple[str, ...]  # every rank's registration key, from the site secret (rank_keys.py)
    env: dict[str, str] = field(default_factory=dict)  # for this node's ranks (GLOO_SOCKET_IFNAME)


@dataclass
class RankProcess:
    site: str
    rank: int
    process: subprocess.Popen | ForkedRank
    log_path: Path


def _log_written(rank: RankProcess) -> float:
    try:
        return rank.log_path.stat().st_mtime
    except OSError:
        return float("inf")


class SiteRanks:
    """Start, watch and stop the rank processes of one site. ``proxies``: peer site ->
    HTTP CONNECT proxy URL; ``first_device``: LOCAL_RANK of rank 0 (sites sharing a GPU
    host take turns); ``node``: this node's share of a site on several (None: all here)."""

    def __init__(
        self,
        config: JobConfig,
        site: str,
        run_dir: Path,
        coordinator: str,
        proxies: dict[str, str],
        *,
        first_device: int = 0,
        threads: int = 1,
        config_file: Path | None = None,
        run_token: str | None = None,
        extra_env: dict[str, str] | None = None,
        node: NodeSlice | None = None,
    ) -> None:
        self.config, self.site, self.run_dir = config, site, run_dir
        self.node = node
        self.extra_env = dict(extra_env or {})
        self.coordinator, self.proxies = coordinator, proxies
        self.first_device, self.threads = first_device, threads
        self.config_file = config_file or config_path(run_dir, None)
        self.run_token = run_token
        self.ranks: list[RankProcess] = []
        self.store_dir: Path | None = None  # the 0700 folder of the ranks' FileStore
        self.agent: HostAgent | None = None  # the ranks' host agent (``run.host_agent``)
        self._spawner: threading.Thread | None = None
        self._spawn_error: BaseException | None = None
        self._closing = threading.Event()

    def start(self) -> None:
        """Start the site's ranks; they meet in a FileStore in a fresh 0700 folder on
        this host's disk, not in the run folder (maybe a network filesystem, where file
        locks are slow or absent). Forked ranks start in the background (the first waits
        for the zygote's imports, seconds) while the launcher's progress line goes on;
        :attr:`started` says when all are."""
        world = self.config.ranks_of(self.site)
        # The folder is this launcher's own (mkdtemp: 0700, a name nobody predicted):
        # the agent's socket in it is out of other users' reach (issue 59).
        self.store_dir = Path(tempfile.mkdtemp(prefix=f"isthmus-store-{self.site}-"))
        here = self.local_ranks
        several = here > 1 or self.node is not None
        if self.config.run.host_agent and several and len(self.config.site_names) > 1:
            self.agent = self._start_agent(here, self.store_dir)
            if threading.current_thread() is threading.main_thread():
                signal.signal(AGENT_STOP_SIGNAL, self._stop_agent_on_signal)
        envs = self._rank_envs(world)
        if not fork_ranks():
            self._spawn(envs)
            return
        self._spawner = threading.Thread(
            target=self._spawn, args=(envs,), name=f"{self.site}-ranks", daemon=True
        )
        self._spawner.start()

    @property
    def local_ranks(self) -> int:
        """How many ranks this launcher starts: the site's, or its node's share."""
        return self.node.count if self.node is not None else self.config.ranks_of(self.site)

    @property
    def started(self) -> bool:
        """Every rank is started (or could not be: :meth:`failed` raises then)."""
        return self._spawner is None or not self._spawner.is_alive()

    def _start_agent(self, ranks: int, store_dir: Path) -> HostAgent:
        """The ranks' agent at their coordinator, with their credentials, on a socket in
        the 0700 store folder: no other user of this machine can reach it."""
        security = site_security(self.config.security, self.site, self.run_token)
        self._agent_channel = peer_channel(self.coordinator, security=security)
        agent = HostAgent(
            self._agent_channel, site=self.site, ranks=ranks, listen=f"unix:{store_dir}/agent"
        )
        return agent.start()

    def _stop_agent_on_signal(self, *_) -> None:
        agent = self.agent
        if agent is None:
            return
        print(
            f"{self.site}: host agent stopped ({AGENT_STOP_SIGNAL.name}): its ranks call the "
            "coordinator themselves",
            file=sys.stderr,
            flush=True,
        )
        # Its server's grace and its watcher's join take seconds: not in a handler.
        threading.Thread(target=agent.stop, name="agent-stop", daemon=True).start()

    def _rank_envs(self, world: int) -> list[dict[str, str]]:
        # The coordinator in this process drew one key per rank: only the process
        # started here as rank r may register as it (inter/control/rank_keys.py).
        node = self.node
        assert self.store_dir is not None  # start() made it
        if node is None:  # every rank on this host: a FileStore in the 0700 folder
            first, keys = 0, handout(self.coordinator)
            meet = {STORE_ENV: str(self.store_dir / "store")}
        else:
            first, keys = node.first, node.keys
            host, _, port = node.master.rpartition(":")
            meet = {"MASTER_ADDR": host, "MASTER_PORT": port, **node.env}
        envs = []
        for local in range(self.local_ranks):
            rank = first + local
            env = {
                **{k: v for k, v in os.environ.items() if k not in (KEY_ENV, STORE_ENV)},
                **({KEY_ENV: keys[rank]} if keys is not None and rank < len(keys) else {}),
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(self.first_device + local),
                "LOCAL_WORLD_SIZE": str(self.local_ranks),
                **meet,
                "OMP_NUM_THREADS": str(self.threads),
                "ISTHMUS_CONFIG": str(self.config_file),
                "ISTHMUS_SITE": self.site,
                "ISTHMUS_COORDINATOR": self.coordinator,
                "ISTHMUS_PROXIES": json.dumps(self.proxies),
                "ISTHMUS_RUN_DIR": str(self.run_dir),
                # The launcher's token for this run, if it made one (deploy/launch/local.py).
                **({"ISTHMUS_RUN_TOKEN": self.run_token} if self.run_token else {}),
                # gRPC skips a proxy for hosts listed in no_proxy (often localhost):
                # name none, so lanes really cross the emulated link.
                "no_grpc_proxy": "none.invalid",
                "ISTHMUS_LAUNCHER_PID": str(os.getpid()),
                **({AGENT_ENV: self.agent.address} if self.agent is not None else {}),
                **self.extra_env,
            }
            envs.append(env)
        return envs

    def _spawn(self, envs: list[dict[str, str]]) -> None:
        try:
            for env in envs:
                if self._closing.is_set():
                    return
                rank = int(env["RANK"])
                log_path = self.run_dir / "logs" / f"{self.site}-rank{rank}.log"
                process = _start_rank(env, log_path)
                self.ranks.append(RankProcess(self.site, rank, process, log_path))
        except Exception as exc:  # (raised in the launcher's thread by failed())
            if self._spawner is None:
                raise
            self._spawn_error = exc

    def failed(self) -> RankProcess | None:
        """The rank that failed first, if any: the one whose log was written last the
        earliest (the others fail a moment later, with "connection reset by peer").
        LaunchError: a rank could not be started at all."""
        if self._spawn_error is not None:
            raise LaunchError(f"{self.site}: its ranks could not start: {self._spawn_error}")
        failed = [r for r in self.ranks if r.process.poll() not in (None, 0)]
        return min(failed, key=_log_written, default=None)

    def done(self) -> bool:
        return (
            self.started
            and len(self.ranks) == self.local_ranks
            and all(r.process.poll() == 0 for r in self.ranks)
        )

    @staticmethod
    def describe_failure(failed: RankProcess) -> str:
        """One line: which rank, its exit code, its last error line, where its log is;
        or, with no error line on a full disk, that it could not write one (issue 33)."""
        code = failed.process.returncode
        head = f"{failed.site} rank {failed.rank} exited with code {code}"
        if code is not None and code < 0:
            head += f" ({_signal_name(-code)})"
        try:
            lines = failed.log_path.read_text(errors="replace").strip().splitlines()
            disk = os.statvfs(failed.log_path.parent)
        except OSError as exc:
            return f"{head}: its log {failed.log_path} cannot be read: {exc.strerror or exc}"
        errors = [line for line in lines if line.startswith("error:")]
        if not errors and disk.f_bavail * disk.f_frsize < FULL_BELOW:
            return (
                f"{head}: no space left on device (ENOSPC) writing {failed.log_path}: the "
                "disk of the run folder is full, and the rank's log could not take its error"
            )
        crash = _native_crash(lines)
        if errors:
            last = errors[-1][len("error:") :].strip()
        else:
            last = crash or (lines[-1] if lines else "")
        return f"{head}: {last} (log: {failed.log_path})"

    def describe(self) -> list[dict]:
        return [
            {
                "site": r.site,
                "rank": r.rank,
                "pid": r.process.pid,
                # The zygote that forked the rank, or this launcher that started it.
                "parent_pid": getattr(r.process, "parent", os.getpid()),
                "log": str(r.log_path),
            }
            for r in self.ranks
        ]

    def close(self) -> None:
        """Terminate what still runs, then kill what ignores it (idempotent)."""
        self._closing.set()
        if self._spawner is not None:  # a rank it is forking now is then ended below
            self._spawner.join(timeout=READY_S)
        for r in self.ranks:
            if r.process.poll() is None:
                r.process.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for r in self.ranks:
            try:
                r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait()
        self.ranks.clear()
        if self.agent is not None:
            self.agent.stop()
            self._agent_channel.close()
            self.agent = None
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None


def _start_rank(env: dict[str, str], log_path: Path) -> subprocess.Popen | ForkedRank:
    """One rank process: forked from this launcher's zygote, or an interpreter of its
    own where there is none."""
    zygote = shared_zygote({k: v for k, v in env.items() if k not in RANK_ONLY_ENV})
    if zygote is not None:
        try:
            return zygote.start(env, log_path)
        except ZygoteError as exc:
            log.warning("%s; this rank starts as an interpreter of its own", exc)
    with log_path.open("w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "isthmus.deploy.rank.program"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _native_crash(lines: list[str]) -> str | None:
    """faulthandler's report of a crash in native code (the rank enables it), cut to one
    line: the error and the crashing thread's innermost Python frame. The log's last
    line would be some other thread's outermost frame."""
    fatal = next(
        (i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")), None
    )
    if fatal is None:
        return None
    # With every thread's stack, the others come first and the crashing one is last.
    rest = lines[fatal + 1 :]
    current = next((i for i, line in enumerate(rest) if line.startswith("Current thread")), -1)
    frame = next((f.strip() for f in rest[current + 1 :] if f.strip().startswith("File ")), "")
    return lines[fatal] + (f", in {frame}" if frame else "")
