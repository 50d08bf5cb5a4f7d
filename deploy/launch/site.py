"""`isthmus site`: one site of a job, started by its own operator or scheduler.

It serves the site's coordinator at the address the job config gives it
(`cluster.coordinators.SITE`), starts the site's ranks, waits for the peer sites
with a visible countdown, trains, then waits for every peer's final parameter
digest so it can say whether the replicas ended identical, and exits. A script that
raises in a rank of any site stops every site (inter/control/abort.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from isthmus.deploy.config.job import ConfigError, JobConfig
from isthmus.deploy.launch.local import check_supported
from isthmus.deploy.launch.progress import Progress
from isthmus.deploy.launch.ranks import LaunchError, SiteRanks, config_path, prepare_run_dir
from isthmus.deploy.launch.zygote import prestart
from isthmus.deploy.reports.summary import summarize
from isthmus.deploy.security.trust import site_security
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings

PEER_DIGEST_WAIT_S = 30.0


def coordinator_for(config: JobConfig, site: str) -> Coordinator:
    """The site's coordinator, bound where `cluster.coordinators` says peers find it."""
    if site not in config.site_names:
        raise ConfigError(f"--site {site!r} is not one of {config.site_names}")
    addresses = config.cluster.coordinators
    missing = [s for s in config.site_names if s not in addresses and s != site]
    if missing:
        raise ConfigError(
            f"cluster.coordinators has no address for {missing}; set e.g. "
            f"--set cluster.coordinators.{missing[0]}=HOST:PORT"
        )
    host, _, port = addresses.get(site, "127.0.0.1:0").rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"cluster.coordinators.{site} must be HOST:PORT, got {addresses[site]!r}")
    settings = CoordinatorSettings(
        site=site,
        site_names=tuple(config.site_names),
        ranks=config.ranks_of(site),
        site_ranks=tuple(config.site_ranks),
        fingerprint=config.fingerprint(),
        host=host or "127.0.0.1",
        port=int(port),
        join_timeout_s=config.sync.timeout_s,
        metrics_port=None if config.run.metrics_port < 0 else config.run.metrics_port,
        **config.coordinator_options(),
    )
    return Coordinator(
        settings,
        peers={s: a for s, a in addresses.items() if s != site},
        proxies={s: u for s, u in config.cluster.proxies.items() if s != site and u},
        security=site_security(config, site),
    )


@dataclass
class SiteJob:
    """One site of a multi-site job, on this machine."""

    config: JobConfig
    site: str
    out: TextIO = sys.stderr
    progress: bool = True
    run_dir: Path = field(init=False)
    temporary_run_dir: bool = field(init=False, default=False)
    coordinator: Coordinator | None = field(init=False, default=None)
    _ranks: SiteRanks | None = field(init=False, default=None)

    def run(self) -> dict:
        """Train this site to the end; returns its summary with every site's digest.

        Raises:
            LaunchError: a rank failed, a peer refused the job, or replicas differ.
            ConfigError: a setting this launcher cannot honour.
        """
        threads = max(1, (os.cpu_count() or 1) // self.config.ranks_of(self.site))
        prestart(threads)  # the ranks' imports, beside this launcher's own work below
        check_supported(self.config, self.config.ranks_of(self.site))
        self.coordinator = coordinator_for(self.config, self.site)
        os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (see deploy/launch/ranks.py)
        self.run_dir, self.temporary_run_dir = prepare_run_dir(self.config, self.site)
        try:
            self.coordinator.start()
            self._ranks = SiteRanks(
                self.config,
                self.site,
                self.run_dir,
                self.coordinator.address,
                {s: u for s, u in self.config.cluster.proxies.items() if s != self.site and u},
                threads=threads,
                config_file=config_path(self.run_dir, self.site),
            )
            self._ranks.start()
            self._train()
            agent = self._ranks.agent
            summary = summarize(
                self.config,
                self.run_dir,
                sites=[self.site],
                host_agents={self.site: agent.stats()} if agent is not None else None,
            )
            summary["digests"] = self._final_digests(summary["digests"][self.site])
            path = self.run_dir / "sites" / self.site / "summary.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
            return summary
        finally:
            self.close()

    def _train(self) -> None:
        assert self.coordinator is not None and self._ranks is not None
        progress = Progress(
            self.config, self.run_dir, self.out, enabled=self.progress, sites=[self.site]
        )
        deadline = time.monotonic() + self.config.sync.timeout_s
        last_status = 0.0
        try:
            while not self._ranks.done():
                if self.coordinator.error:
                    raise LaunchError(self.coordinator.error)
                aborted = self.coordinator.aborted
                if aborted and not self.coordinator.aborted_here:
                    raise LaunchError(f"the job stopped at every site: {aborted}")
                failed = self._ranks.failed()
                if failed is not None:
                    if self.coordinator.aborted_here:
                        # The script raised here: stay until the peers heard it (their
                        # next heartbeat), so they stop too rather than fail over.
                        self.coordinator.tell_peers_of_abort()
                    raise LaunchError(SiteRanks.describe_failure(failed))
                if self.coordinator.generation == 0 and time.monotonic() - last_status > 5:
                    waiting = [
                        p for p in self.coordinator.peers if p not in self.coordinator.last_seen
                    ]
                    left = max(0, deadline - time.monotonic())
                    progress.status(
                        f"waiting for {', '.join(waiting) or 'ranks to register'}: {left:.0f} s left"
                    )
                    last_status = time.monotonic()
                progress.update()
                time.sleep(0.2)
        finally:
            progress.close()

    def _final_digests(self, mine: str) -> dict[str, str]:
        """Wait for every live peer's digest after the last step; LaunchError if any
        differs. Sites the job went on without (dead, or never came back) are not waited for."""
        assert self.coordinator is not None
        self.coordinator.drain()
        steps = self.config.job.steps
        deadline = time.monotonic() + PEER_DIGEST_WAIT_S
        names = self.coordinator.live_members()
        while self.coordinator.replicas.agree_at(steps, names) is None:
            if time.monotonic() > deadline:
                missing = [s for s, (st, _) in self._latest().items() if st != steps]
                raise LaunchError(
                    f"no final digest from {missing or 'peers'} after {PEER_DIGEST_WAIT_S:.0f}s"
                )
            time.sleep(0.1)
        digests = {site: digest for site, (_, digest) in self._latest().items() if site in names}
        digests[self.site] = mine
        if not self.coordinator.replicas.agree_at(steps, names):
            raise LaunchError(f"sites ended with different parameters: {digests}")
        return digests

    def _latest(self) -> dict[str, tuple[int, str]]:
        assert self.coordinator is not None
        latest = self.coordinator.replicas.latest()
        return {s: latest.get(s, (0, "")) for s in self.config.site_names}

    def close(self) -> None:
        """Stop the ranks and the coordinator (idempotent)."""
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        if self.coordinator is not None:
            self.coordinator.stop()
