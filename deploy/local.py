"""`isthmus local`: every site of a job on this machine, joined by emulated links.

The launcher owns everything it starts and tears it all down on exit, on error
and on Ctrl-C: the WAN emulator (one link per pair of sites, an HTTP CONNECT
proxy per direction so any gRPC channel can be routed across it), one
coordinator per site, one TCPStore per site (each site is its own
torch.distributed world) and the rank processes. Ranks die with the launcher
even if it is killed: each rank asks Linux for PR_SET_PDEATHSIG itself (a
preexec_fn would fork, and gRPC's threads in this process make fork noisy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from isthmus.deploy.config import ConfigError, JobConfig, dump_toml
from isthmus.deploy.progress import Progress
from isthmus.deploy.summary import summarize
from isthmus.inter.coordinator import Coordinator
from isthmus.sim import LinkSpec, RelayServer

TERMINATE_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """The job failed; the message says where and why, in one line."""


@dataclass
class RankProcess:
    site: str
    rank: int
    process: subprocess.Popen
    log_path: Path


@dataclass
class LocalJob:
    """One run of every site of a job on this machine.

    Args:
        config: the validated job config.
        out: where the progress line and the summary go.
        progress: show the progress line.
    """

    config: JobConfig
    out: TextIO = sys.stderr
    progress: bool = True
    run_dir: Path = field(init=False)
    _keep_run_dir: bool = field(init=False, default=True)
    _ranks: list[RankProcess] = field(init=False, default_factory=list)
    _coordinators: list[Coordinator] = field(init=False, default_factory=list)
    _stores: list[object] = field(init=False, default_factory=list)
    _wan: RelayServer | None = field(init=False, default=None)

    def run(self) -> dict:
        """Run the job to completion; returns the summary (also in run_dir/summary.json).

        Raises:
            LaunchError: a rank failed, a site was refused, or replicas diverged.
            ConfigError: a setting this launcher cannot honour.
        """
        self._check_supported()
        self._prepare_run_dir()
        try:
            self._start()
            self._wait()
            summary = summarize(self.config, self.run_dir)
            if len(set(summary["digests"].values())) != 1:
                raise LaunchError(f"sites ended with different parameters: {summary['digests']}")
            return summary
        finally:
            self.close()

    # -- setup --------------------------------------------------------------------

    def _check_supported(self) -> None:
        t = self.config.topology
        if t.pp > 1 or t.tp > 1:
            raise ConfigError(
                f"topology.pp={t.pp} topology.tp={t.tp}: only data parallelism inside a "
                "site is supported in this release; set pp = 1 and tp = 1"
            )
        if t.device == "cuda":
            import torch

            need = t.sites * t.ranks_per_site
            have = torch.cuda.device_count()
            if have < need:
                raise ConfigError(f"topology.device = cuda needs {need} GPUs, found {have}")

    def _prepare_run_dir(self) -> None:
        if self.config.run.run_dir:
            self.run_dir = Path(self.config.run.run_dir).resolve()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix="isthmus-run-"))
            self._keep_run_dir = False
        for stale in ("metrics.jsonl", "summary.json", "sites"):
            path = self.run_dir / stale
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        (self.run_dir / "logs").mkdir(exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_toml(self.config))

    def _start(self) -> None:
        import torch.distributed as dist

        config = self.config
        sites = config.site_names
        proxies: dict[str, dict[str, str]] = {site: {} for site in sites}
        if len(sites) > 1:
            self._wan = RelayServer().start()
            spec = LinkSpec.symmetric(
                latency_s=config.one_way_latency_s,
                bandwidth_bps=config.wan.bandwidth_mbit * 1e6,
                queue_bytes=config.wan.queue_kib * 1024,
            )
            for i, a in enumerate(sites):
                for b in sites[i + 1 :]:
                    link = self._wan.add_link(f"{a}-{b}", spec)
                    host, port = link.add_proxy(initiator="a")
                    proxies[a][b] = f"http://{host}:{port}"
                    host, port = link.add_proxy(initiator="b")
                    proxies[b][a] = f"http://{host}:{port}"
        # gRPC skips a proxy for hosts listed in no_proxy (often localhost): name
        # none, so coordinator and lane channels really cross the emulated link.
        os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (gRPC reads lowercase)
        for site in sites:
            coordinator = Coordinator(
                site=site,
                site_names=sites,
                ranks=config.topology.ranks_per_site,
                fingerprint=config.fingerprint(),
                join_timeout_s=config.sync.timeout_s,
            )
            self._coordinators.append(coordinator)
        addresses = {c.site: c.address for c in self._coordinators}
        for coordinator in self._coordinators:
            coordinator.set_peers(
                {s: a for s, a in addresses.items() if s != coordinator.site},
                proxies[coordinator.site],
            )
            coordinator.start()

        world = config.topology.ranks_per_site
        threads = max(1, (os.cpu_count() or 1) // (world * len(sites)))
        device_index = 0
        for site, coordinator in zip(sites, self._coordinators, strict=True):
            # The launcher hosts each site's rendezvous store, so no rank races for
            # a port; ranks join it as clients (torchelastic's agent-store mode).
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            self._stores.append(store)
            for rank in range(world):
                env = {
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(device_index),
                    "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "OMP_NUM_THREADS": str(threads),
                    "ISTHMUS_CONFIG": str(self.run_dir / "config.toml"),
                    "ISTHMUS_SITE": site,
                    "ISTHMUS_COORDINATOR": coordinator.address,
                    "ISTHMUS_PROXIES": json.dumps(proxies[site]),
                    "ISTHMUS_RUN_DIR": str(self.run_dir),
                    "no_grpc_proxy": "none.invalid",
                    "ISTHMUS_LAUNCHER_PID": str(os.getpid()),
                }
                device_index += 1
                log_path = self.run_dir / "logs" / f"{site}-rank{rank}.log"
                with log_path.open("w") as log_file:
                    process = subprocess.Popen(
                        [sys.executable, "-m", "isthmus.deploy.rank"],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                    )
                self._ranks.append(RankProcess(site, rank, process, log_path))
        self._write_job_file(proxies, [store.port for store in self._stores])

    def _write_job_file(self, proxies: dict[str, dict[str, str]], store_ports: list[int]) -> None:
        # What this run started and where, for operators and for the teardown tests.
        job = {
            "launcher_pid": os.getpid(),
            "coordinators": {c.site: c.address for c in self._coordinators},
            "proxies": proxies,
            "store_ports": store_ports,
            "ranks": [
                {"site": r.site, "rank": r.rank, "pid": r.process.pid, "log": str(r.log_path)}
                for r in self._ranks
            ],
        }
        (self.run_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n")

    # -- monitoring ---------------------------------------------------------------

    def _wait(self) -> None:
        progress = Progress(self.config, self.run_dir, self.out, enabled=self.progress)
        try:
            while True:
                for coordinator in self._coordinators:
                    if coordinator.error:
                        raise LaunchError(coordinator.error)
                failed = [r for r in self._ranks if r.process.poll() not in (None, 0)]
                if failed:
                    raise LaunchError(self._describe_failure(failed[0]))
                progress.update()
                if all(r.process.poll() == 0 for r in self._ranks):
                    return
                time.sleep(0.2)
        finally:
            progress.close()

    def _describe_failure(self, failed: RankProcess) -> str:
        # A refused join is the root cause of whatever the ranks then report.
        for coordinator in self._coordinators:
            if coordinator.error:
                return coordinator.error
        lines = failed.log_path.read_text(errors="replace").strip().splitlines()
        errors = [line for line in lines if line.startswith("error:")]
        last = errors[-1][len("error:") :].strip() if errors else (lines[-1] if lines else "")
        return (
            f"{failed.site} rank {failed.rank} exited with code {failed.process.returncode}: "
            f"{last} (log: {failed.log_path})"
        )

    # -- teardown -----------------------------------------------------------------

    def close(self) -> None:
        """Stop everything this job started (idempotent)."""
        for r in self._ranks:
            if r.process.poll() is None:
                r.process.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for r in self._ranks:
            try:
                r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.process.kill()
                r.process.wait()
        self._ranks.clear()
        for coordinator in self._coordinators:
            coordinator.stop()
        self._coordinators.clear()
        self._stores.clear()  # a TCPStore's server closes when the object goes
        if self._wan is not None:
            self._wan.close()
            self._wan = None
