"""Secure by default: a site reachable beyond loopback runs with mutual TLS and the job
token, or starts only when its operator says ``--insecure`` (and is warned every start).

Tried from outside (issue 14), a plaintext site without a token lets anyone who reaches
its ports vote, propose, heartbeat a false digest or pull the whole training state; on
loopback that is the machine's own users, beyond it the network's. What a site listens
on: its coordinator (with its metrics) where ``cluster.coordinators.SITE`` or
``--listen`` says, and its lanes (with their bulk ports) on ``cluster.lane_host``.
torch's TCPStore is always on loopback (deploy/launch/ranks.py)."""

from __future__ import annotations

from typing import TextIO

from isthmus.deploy.config.run_sections import ClusterSection, SecuritySection
from isthmus.deploy.config.sections import ConfigError
from isthmus.sim.connect import is_loopback as loopback_literal

__all__ = ["check_exposure", "exposed_listeners", "is_loopback"]


def is_loopback(host: str) -> bool:
    """``sim``'s test (127.0.0.0/8, ::1, localhost), with "" as loopback: our servers
    read an empty host as 127.0.0.1."""
    return loopback_literal(host.strip() or "127.0.0.1")


def exposed_listeners(cluster: ClusterSection, site: str, coordinator_host: str) -> list[str]:
    """What of ``site`` would listen beyond loopback, in words naming the setting."""
    out = []
    if not is_loopback(coordinator_host):
        out.append(f"its coordinator on {coordinator_host} (cluster.coordinators.{site}/--listen)")
    if not is_loopback(cluster.lane_host):
        out.append(f"its lanes on {cluster.lane_host} (cluster.lane_host)")
    return out


def check_exposure(
    sec: SecuritySection,
    cluster: ClusterSection,
    site: str,
    coordinator_host: str,
    warn_to: TextIO | None = None,
) -> None:
    """Refuse (ConfigError) a site exposed without mutual TLS and the job token, unless
    ``security.insecure`` (``--insecure``); then print a warning to ``warn_to``."""
    exposed = exposed_listeners(cluster, site, coordinator_host)
    if not exposed and sec.insecure and not sec.require_token and warn_to is not None:
        print(
            f"warning: --insecure: {site} runs without a job token: anyone on this machine "
            "can call its coordinator and lanes",
            file=warn_to,
            flush=True,
        )
    if not exposed or (sec.require_tls and sec.require_token):
        return
    what = " and ".join(exposed)
    wanted = {"security.require_tls": sec.require_tls, "security.require_token": sec.require_token}
    missing = [name for name, on in wanted.items() if not on]
    if not sec.insecure:
        raise ConfigError(
            f"{site} would serve {what} without {' and '.join(missing)}: anyone who reaches "
            "it could vote, propose or pull the training state. Turn them on (isthmus certs; "
            "docs/security.md), or pass --insecure to run it exposed anyway"
        )
    if warn_to is not None:
        print(
            f"warning: --insecure: {site} serves {what} without {' and '.join(missing)}",
            file=warn_to,
            flush=True,
        )
