"""`isthmus site`: one site of a job, started by its own operator or scheduler.

It serves the site's coordinator at the address the job config gives it
(`cluster.coordinators.SITE`), starts the site's ranks, waits for the peer sites
with a visible countdown, trains, then waits for every peer's final parameter
digest so it can say whether the replicas ended identical, and exits. A script that
raises in a rank of any site stops every site (inter/control/abort.py).

A site on several nodes runs one launcher a node (``--nodes N --node-rank K``), as
torchrun runs one a node: node 0 serves the coordinator, and every node starts its
share of the ranks and its own host agent; the ranks meet in torch's env://
rendezvous at the first node (:class:`NodePlace`)."""

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
from isthmus.deploy.launch.ranks import (
    LaunchError,
    NodeSlice,
    SiteRanks,
    config_path,
    prepare_run_dir,
)
from isthmus.deploy.launch.zygote import prestart
from isthmus.deploy.reports.summary import summarize
from isthmus.deploy.security.trust import site_security
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.rank_keys import RankKeys, derived_key

PEER_DIGEST_WAIT_S = 30.0
MASTER_PORT = 29500
"""torchrun's default port for the env:// rendezvous of a site on several nodes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePlace:
    """Where this launcher sits in its site: one node of ``nodes``. Node 0 serves the
    site's coordinator (at ``listen``, else where ``cluster.coordinators`` says); the
    other nodes' ranks and agents reach it at ``master_addr`` on the coordinator's port."""

    nodes: int = 1
    node_rank: int = 0
    master_addr: str = ""  # the first node's address as the site's other nodes reach it
    master_port: int = MASTER_PORT  # of the ranks' env:// rendezvous on the first node
    listen: str = ""  # HOST:PORT the coordinator binds (node 0); "": cluster.coordinators.SITE
    rank_secret: bytes | None = None  # every node derives its ranks' keys from it
    gloo_ifname: str = ""  # the interface the ranks' gloo traffic takes ("": gloo's choice)

    def check(self, config: JobConfig, site: str) -> None:
        """Raises ConfigError naming the flag when the place cannot hold the site."""
        ranks = config.ranks_of(site) if site in config.site_names else 0
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"--node-rank must be in [0, {self.nodes}), got {self.node_rank}")
        if self.nodes == 1:
            return
        if ranks % self.nodes:
            raise ConfigError(
                f"{site} has {ranks} ranks, which {self.nodes} nodes cannot share evenly: "
                "set topology.ranks_per_site to a multiple of --nodes"
            )
        if not self.master_addr:
            raise ConfigError("--nodes > 1 needs --master-addr, the first node's address")
        if self.rank_secret is None:
            raise ConfigError(
                "--nodes > 1 needs --rank-secret-file: each node derives its ranks' keys "
                "from the site secret, so only the job's ranks can register"
            )

    def coordinator_port(self, config: JobConfig, site: str) -> str:
        address = self.listen or config.cluster.coordinators.get(site, "127.0.0.1:0")
        return address.rpartition(":")[2]

    def slice(self, config: JobConfig, site: str) -> NodeSlice | None:
        """This node's ranks, or None for a site on one node."""
        if self.nodes == 1:
            return None
        assert self.rank_secret is not None  # check() said so
        ranks = config.ranks_of(site)
        count = ranks // self.nodes
        return NodeSlice(
            first=self.node_rank * count,
            count=count,
            master=f"{self.master_addr}:{self.master_port}",
            keys=tuple(derived_key(self.rank_secret, site, r) for r in range(ranks)),
            env={"GLOO_SOCKET_IFNAME": self.gloo_ifname} if self.gloo_ifname else {},
        )


def coordinator_for(config: JobConfig, site: str, place: NodePlace | None = None) -> Coordinator:
    """The site's coordinator, bound where `cluster.coordinators` says peers find it
    (or where ``place.listen`` says)."""
    if site not in config.site_names:
        raise ConfigError(f"--site {site!r} is not one of {config.site_names}")
    addresses = config.cluster.coordinators
    missing = [s for s in config.site_names if s not in addresses and s != site]
    if missing:
        raise ConfigError(
            f"cluster.coordinators has no address for {missing}; set e.g. "
            f"--set cluster.coordinators.{missing[0]}=HOST:PORT"
        )
    place = place or NodePlace()
    bind = place.listen or addresses.get(site, "127.0.0.1:0")
    host, _, port = bind.rpartition(":")
    if not port.isdigit():
        what = "--listen" if place.listen else f"cluster.coordinators.{site}"
        raise ConfigError(f"{what} must be HOST:PORT, got {bind!r}")
    secret = place.rank_secret
    keys = RankKeys.derive(site, config.ranks_of(site), secret) if secret is not None else None
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
        security=site_security(config.security, site),
        rank_keys=keys,
    )


@dataclass
class SiteJob:
    """One site of a multi-site job, on this machine."""

    config: JobConfig
    site: str
    out: TextIO = sys.stderr
    progress: bool = True
    place: NodePlace = field(default_factory=NodePlace)
    run_dir: Path = field(init=False)
    temporary_run_dir: bool = field(init=False, default=False)
    coordinator: Coordinator | None = field(init=False, default=None)
    _ranks: SiteRanks | None = field(init=False, default=None)

    def run(self) -> dict:
        """Train this site to the end; returns its summary with every site's digest.
        LaunchError when a rank failed, a peer refused the job, or replicas differ."""
        place = self.place
        place.check(self.config, self.site)
        node = place.slice(self.config, self.site)
        here = node.count if node is not None else self.config.ranks_of(self.site)
        threads = max(1, (os.cpu_count() or 1) // here)
        prestart(threads)  # the ranks' imports, beside this launcher's own work below
        check_supported(self.config, here)
        head = place.node_rank == 0
        if head:
            self.coordinator = coordinator_for(self.config, self.site, place)
        os.environ["no_grpc_proxy"] = "none.invalid"  # noqa: SIM112 (see deploy/launch/ranks.py)
        node_index = place.node_rank if node is not None else None
        self.run_dir, self.temporary_run_dir = prepare_run_dir(self.config, self.site, node_index)
        try:
            if self.coordinator is not None:
                self.coordinator.start()
            # Ranks of a site on several nodes all dial the first node, the head's
            # own included: one address that every node's TLS and routes agree on.
            if node is not None:
                coordinator = (
                    f"{place.master_addr}:{place.coordinator_port(self.config, self.site)}"
                )
            else:
                assert self.coordinator is not None
                coordinator = self.coordinator.address
            self._ranks = SiteRanks(
                self.config,
                self.site,
                self.run_dir,
                coordinator,
                {s: u for s, u in self.config.cluster.proxies.items() if s != self.site and u},
                threads=threads,
                config_file=config_path(self.run_dir, self.site, node_index),
                node=node,
            )
            self._ranks.start()
            if not head:
                return self._follow()
            self._train()
            agent = self._ranks.agent
            summary = summarize(
                self.config,
                self.run_dir,
                sites=[self.site],
                host_agents={self.site: agent.stats()} if agent is not None else None,
                # Without a run folder the nodes share, the head reads its own ranks'.
                missing_ok=node is not None,
            )
            summary["digests"] = self._final_digests(summary["digests"][self.site])
            path = self.run_dir / "sites" / self.site / "summary.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
            return summary
        finally:
            self.close()

    def _follow(self) -> dict:
        """A node other than the first: its ranks to their end, or the first to fail.
        Returns what this node ran (the site's summary is the first node's)."""
        assert self._ranks is not None
        while not self._ranks.done():
            failed = self._ranks.failed()
            if failed is not None:
                raise LaunchError(SiteRanks.describe_failure(failed))
            time.sleep(0.2)
        ranks = [r.rank for r in self._ranks.ranks]
        return {"site": self.site, "node": self.place.node_rank, "ranks": ranks}

    def _train(self) -> None:
        assert self.coordinator is not None and self._ranks is not None
        topology, steps = self.config.topology, self.config.job.steps
        progress = Progress(
            topology, steps, self.run_dir, self.out, enabled=self.progress, sites=[self.site]
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
