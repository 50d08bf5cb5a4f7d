"""`isthmus local`: every site of a job on this machine, joined by emulated links.

The launcher owns everything it starts and tears it all down on exit, on error
and on Ctrl-C: the WAN emulator (one link per pair of sites, an HTTP CONNECT
proxy per direction so any gRPC channel can be routed across it), one
coordinator per site, and each site's rank processes (`SiteRanks`)."""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from isthmus.deploy.config.host_check import HostFacts, host_problem
from isthmus.deploy.config.job import ConfigError, JobConfig
from isthmus.deploy.launch.progress import Progress
from isthmus.deploy.launch.ranks import LaunchError, SiteRanks, prepare_run_dir
from isthmus.deploy.launch.zygote import prestart
from isthmus.deploy.reports.summary import summarize
from isthmus.deploy.security.trust import checkpoint_key, site_security
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.sim import LinkSpec, RelayServer, Topology, topology_links

__all__ = [
    "LaunchError",
    "LocalJob",
    "check_supported",
    "first_gpus",
    "gpu_shortage",
    "gpus_needed",
    "host_gpus",
    "link_spec",
    "parse_slow",
    "slow_env",
]


def link_spec(config: JobConfig) -> LinkSpec:
    """The link `isthmus local` emulates between every pair of sites, from [wan]."""
    return LinkSpec.symmetric(
        latency_s=config.one_way_latency_s,
        bandwidth_bps=config.wan.bandwidth_mbit * 1e6,
        queue_bytes=config.wan.queue_kib * 1024,
        per_flow_bps=config.wan.per_flow_mbit * 1e6,
    )


def first_gpus(sizes: list[int], gpus: int, share: bool) -> list[int]:
    """The first GPU (LOCAL_RANK of rank 0) of each site of ``sizes`` ranks on a host of
    ``gpus`` GPUs: one after another, or with ``share`` (run.share_gpus) starting again
    at GPU 0 where a site would run past the last one."""
    firsts, offset = [], 0
    for size in sizes:
        if share and offset + size > gpus:
            offset = 0
        firsts.append(offset)
        offset += size
    return firsts


def gpus_needed(config: JobConfig) -> int:
    """GPUs `isthmus local` needs on ``cuda``: every rank its own, or with
    run.share_gpus the largest site's."""
    sizes = config.site_ranks
    return max(sizes) if config.run.share_gpus else sum(sizes)


def gpu_shortage(device: str, have: int, needed: int) -> str | None:
    """Why ranks that need ``needed`` GPUs cannot start on a host of ``have`` with
    topology.device ``device``, or None. ``auto`` on a host with some GPUs but too few is
    refused too: the device is part of the job's fingerprint, compared as written."""
    if device == "cpu" or have >= needed:
        return None
    gpus = "GPU" if needed == 1 else "GPUs"
    if device == "cuda":
        return f"topology.device = cuda needs {needed} {gpus}, found {have}"
    if have == 0:
        return None  # auto without a GPU: the CPU
    return (
        f"topology.device = auto chose cuda, but this host has {have} GPU(s) for {needed} "
        "ranks: set topology.device=cpu, or run.share_gpus=true (isthmus local: the "
        "sites take turns on the GPUs), or fewer ranks"
    )


def host_gpus(config: JobConfig) -> int:
    """The GPUs this host offers the job: none unless it runs on CUDA (``auto``
    imports no torch without the NVIDIA driver)."""
    if config.device_type != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def check_supported(config: JobConfig, needed: int, site_ranks: list[int] | None = None) -> None:
    """Refuse, in one line, what this release or this host cannot run, before anything
    is made. ``site_ranks``: the ranks of each site started on this host; None: one site
    of ``needed`` ranks (`isthmus site`). Loading the corpus (which may train a BPE
    tokenizer and fills in data.tokenizer_sha256) comes last, after the cheap checks."""
    from isthmus.intra.corpus.cache import load_corpus  # imports torch: not for a bad --set

    cuda = config.device_type == "cuda"
    host = HostFacts.here(cuda)
    problem = gpu_shortage(config.topology.device, host.gpus, needed) or host_problem(
        config, host, site_ranks or [needed], cuda=cuda and host.gpus > 0
    )
    if problem:
        raise ConfigError(problem)
    # A corpus that cannot be read or split:
    load_corpus(config.data, seq_len=config.train.seq_len, vocab=config.resolved_model().vocab_size)


@dataclass
class LocalJob:
    """One run of every site of a job on this machine."""

    config: JobConfig
    out: TextIO = sys.stderr
    progress: bool = True
    topology: Topology | None = None
    slow: dict[str, tuple[float, int]] = field(default_factory=dict)  # ``--slow``: parse_slow
    run_dir: Path = field(init=False)
    temporary_run_dir: bool = field(init=False, default=False)
    _sites: list[SiteRanks] = field(init=False, default_factory=list)
    _coordinators: list[Coordinator] = field(init=False, default_factory=list)
    _wan: RelayServer | None = field(init=False, default=None)
    _token: str | None = field(init=False, default=None)
    _token_file: Path | None = field(init=False, default=None)
    _proxies: dict[str, dict[str, str]] = field(init=False, default_factory=dict)

    def run(self) -> dict:
        """Run the job to completion; returns the summary (also in run_dir/summary.json).
        LaunchError when a rank failed, a site was refused, or replicas diverged."""
        prestart(self._threads())  # the ranks' imports, beside this launcher's own work
        check_supported(self.config, gpus_needed(self.config), self.config.site_ranks)
        c = self.config
        checkpoint_key(c.security, c.checkpoint)  # a ConfigError now, not in every rank after start
        try:
            self._make_job_token()
            self.run_dir, self.temporary_run_dir = prepare_run_dir(self.config)
            proxies = self._start_wan()
            self._start_coordinators(proxies)
            self._start_ranks(proxies)
            self._wait()
            agents = {s.site: s.agent.stats() for s in self._sites if s.agent is not None}
            summary = summarize(self.config, self.run_dir, host_agents=agents)
            if len(set(summary["digests"].values())) != 1:
                raise LaunchError(f"sites ended with different parameters: {summary['digests']}")
            return summary
        finally:
            self.close()

    def _make_job_token(self) -> None:
        """A token for this run when the config names none: every user of the machine
        reaches loopback (issue 14). The ranks get it in their environment, not in the
        run's config, which outlives it; a 0600 file named in job.json lets the operator
        call the coordinators. ``--insecure`` runs without one."""
        if self.config.security.require_token or self.config.security.insecure:
            return
        self._token = secrets.token_urlsafe(32)
        fd, path = tempfile.mkstemp(prefix="isthmus-token-")  # mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(self._token + "\n")
        self._token_file = Path(path)

    def _start_wan(self) -> dict[str, dict[str, str]]:
        """One emulated link per pair of sites; returns site -> peer -> proxy URL."""
        config = self.config
        sites = config.site_names
        proxies: dict[str, dict[str, str]] = {site: {} for site in sites}
        if len(sites) == 1:
            return proxies
        self._wan = RelayServer().start()
        if self.topology is not None:
            try:
                links = topology_links(self.topology, sites)
            except ValueError as exc:
                raise ConfigError(f"--topology: {exc}") from None
        else:
            spec = link_spec(config)
            links = {(a, b): spec for i, a in enumerate(sites) for b in sites[i + 1 :]}
        for (a, b), spec in links.items():
            link = self._wan.add_link(f"{a}-{b}", spec)
            host, port = link.add_proxy(initiator="a")
            proxies[a][b] = f"http://{host}:{port}"
            host, port = link.add_proxy(initiator="b")
            proxies[b][a] = f"http://{host}:{port}"
        return proxies

    def _start_coordinators(self, proxies: dict[str, dict[str, str]]) -> None:
        # gRPC skips a proxy for hosts listed in no_proxy (often localhost): name
        # none, so coordinator channels really cross the emulated link.
        os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (gRPC reads lowercase)
        config = self.config
        for site in config.site_names:
            self._coordinators.append(
                Coordinator(
                    CoordinatorSettings(
                        site=site,
                        site_names=tuple(config.site_names),
                        ranks=config.ranks_of(site),
                        site_ranks=tuple(config.site_ranks),
                        fingerprint=config.fingerprint(),
                        join_timeout_s=config.sync.timeout_s,
                        metrics_port=None if config.run.metrics_port < 0 else 0,
                        **config.coordinator_options(),
                    ),
                    security=site_security(config.security, site, self._token),
                )
            )
        addresses = {c.site: c.address for c in self._coordinators}
        for coordinator in self._coordinators:
            coordinator.set_peers(
                {s: a for s, a in addresses.items() if s != coordinator.site},
                proxies[coordinator.site],
            )
            coordinator.start()

    def _threads(self) -> int:  # OMP threads a rank: the host's cores over every site's ranks
        return max(1, (os.cpu_count() or 1) // sum(self.config.site_ranks))

    def _start_ranks(self, proxies: dict[str, dict[str, str]]) -> None:
        sizes = self.config.site_ranks
        threads = self._threads()
        firsts = first_gpus(sizes, host_gpus(self.config), self.config.run.share_gpus)
        for i, coordinator in enumerate(self._coordinators):
            site = SiteRanks(
                self.config,
                coordinator.site,
                self.run_dir,
                coordinator.address,
                proxies[coordinator.site],
                first_device=firsts[i],
                threads=threads,
                run_token=self._token,
                extra_env=slow_env(*self.slow[coordinator.site])
                if coordinator.site in self.slow
                else None,
            )
            self._sites.append(site)
            site.start()
        self._proxies = proxies

    def _write_job(self) -> None:
        """What this run started and where, for operators and the teardown tests; written
        once every site's ranks are started (forked ones start in the background)."""
        proxies = self._proxies
        job = {
            "launcher_pid": os.getpid(),
            "coordinators": {c.site: c.address for c in self._coordinators},
            "metrics": {c.site: c.metrics_address for c in self._coordinators},
            "proxies": proxies,
            # Each site's ranks meet in a FileStore there (a 0700 folder), not on a port.
            "stores": [str(s.store_dir) for s in self._sites],
            # The run's own token (a 0600 file), when the config names none.
            "token_file": str(self._token_file) if self._token_file else None,
            "ranks": [r for s in self._sites for r in s.describe()],
        }
        (self.run_dir / "job.json").write_text(json.dumps(job, indent=2) + "\n")

    def _wait(self) -> None:
        steps, out = self.config.job.steps, self.out
        progress = Progress(self.config.topology, steps, self.run_dir, out, enabled=self.progress)
        written = False
        try:
            while True:
                self._raise_if_failed()
                if not written and all(site.started for site in self._sites):
                    self._write_job()
                    written = True
                progress.update()
                if all(site.done() for site in self._sites):
                    return
                time.sleep(0.2)
        finally:
            progress.close()

    def _raise_if_failed(self) -> None:
        # A refused join is the root cause of whatever the ranks then report.
        for coordinator in self._coordinators:
            if coordinator.error:
                raise LaunchError(coordinator.error)
        for site in self._sites:
            failed = site.failed()
            if failed is not None:
                raise LaunchError(site.describe_failure(failed))

    def close(self) -> None:
        """Stop everything this job started (idempotent)."""
        for site in self._sites:
            site.close()
        self._sites.clear()
        for coordinator in self._coordinators:
            coordinator.leave()  # all at once, so none reports the others leaving
        for coordinator in self._coordinators:
            coordinator.stop()
        self._coordinators.clear()
        if self._wan is not None:
            self._wan.close()
            self._wan = None
        if self._token_file is not None:
            self._token_file.unlink(missing_ok=True)
            self._token_file = None


def slow_env(factor: float, from_step: int) -> dict[str, str]:
    """The environment that slows a site's ranks (deploy/rank/faults.py)."""
    return {"ISTHMUS_SLOWDOWN": str(factor), "ISTHMUS_SLOW_FROM_STEP": str(from_step)}


def parse_slow(specs: list[str], sites: list[str]) -> dict[str, tuple[float, int]]:
    """``SITE=FACTOR[@STEP]`` options (``isthmus local --slow``), checked."""
    out: dict[str, tuple[float, int]] = {}
    for spec in specs:
        site, _, rest = spec.partition("=")
        factor, _, step = rest.partition("@")
        try:
            value, first = float(factor), int(step or 0)
        except ValueError:
            value, first = -1.0, -1
        if site not in sites:
            raise ConfigError(f"--slow {spec}: no site {site!r} in this job ({', '.join(sites)})")
        if not (value >= 1 and first >= 0):
            raise ConfigError(
                f"--slow {spec}: want SITE=FACTOR[@STEP] with FACTOR >= 1 and STEP >= 0, "
                "e.g. site1=2@20"
            )
        out[site] = (value, first)
    return out
