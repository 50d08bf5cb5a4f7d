"""The processes of a chaos scenario's sites: one `isthmus site` launcher a site, or one
a node for a site on two nodes (deploy/chaos/suite.py starts, signals and judges them)."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from isthmus.deploy.chaos.ports import free_ports

__all__ = ["NODE1", "SiteProcess", "node_argvs", "site_processes"]


@dataclass
class SiteProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        log = self.log.with_suffix(f".{self.starts}.log")
        with log.open("w") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # one process group: the site and its ranks
            )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def signal_group(self, number: signal.Signals) -> None:
        """``number`` to the site's launcher and every process it started."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, number)

    def text(self) -> str:
        """Everything its latest start logged."""
        try:
            return self.log.with_suffix(f".{self.starts}.log").read_text()
        except OSError:
            return ""

    def tail(self, chars: int = 1500) -> str:
        return self.text()[-chars:]


NODE1 = "/node1"
"""A two-node site's second launcher is ``sites[SITE + NODE1]``; ``sites[SITE]`` is its
first, which serves the coordinator and speaks for the site."""


def node_argvs(argv: list[str], secret: Path) -> list[list[str]]:
    """The two node launchers of a site on two nodes of this machine: each node's
    `isthmus site` as deploy/slurm and deploy/k8s run it, sharing a site secret."""
    secret.touch(mode=0o600)
    secret.write_text(os.urandom(32).hex())
    (master_port,) = free_ports(1)
    common = ["--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    common += ["--rank-secret-file", str(secret)]
    return [[*argv, *common, "--node-rank", str(node)] for node in (0, 1)]


def site_processes(sites: dict[str, SiteProcess], name: str) -> list[SiteProcess]:
    """A site's launchers: one, or one a node."""
    return [s for key, s in sites.items() if key == name or key == f"{name}{NODE1}"]
