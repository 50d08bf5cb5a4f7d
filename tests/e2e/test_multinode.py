"""A site across hosts: site1's two ranks on two network namespaces standing for two
nodes, site0 in a third, the sites joined by the emulated WAN in transparent mode.

site1's ranks are started by a program other than ours (srun or torchrun straight onto
the rank program, beside `isthmus coordinator --rank-secret-file`; the templates run
`isthmus site --nodes` instead: tests/deploy/test_slurm.py), with `ip netns exec` in
place of that program: `isthmus coordinator` and rank 0 on its first node, rank 1 on
the second, torch's env:// rendezvous at the first node's LAN address (gloo over the
site's LAN bridge, never the WAN), each rank's lane advertised at its own node's
address. site0 is `isthmus site` in its namespace. Every cross-site byte, the second
node's lane included, can only cross through the relay's link (sim/netns.py).

Needs root (namespaces, iptables), as CI is; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import root_wan

from isthmus.deploy.config.job import load_config
from isthmus.sim import LinkSpec
from isthmus.sim.netns import LAN_IFNAME, SiteNet
from isthmus.sim.transparent import TransparentWan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SPEC = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=1e9)
COORDINATOR_PORT, MASTER_PORT = 7070, 29500  # each namespace is fresh: fixed ports are free
DEADLINE_S = 300  # six processes importing torch at once on a loaded 2-core machine
CLI = [sys.executable, "-m", "isthmus.deploy.cli"]


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


@dataclass
class MultiNodeSite:
    """site1 as the multi-node template runs it; `failed()` stands for srun's
    --kill-on-bad-exit and the template's trap: a rank that dies takes the site down."""

    net: SiteNet
    config: Path
    run_dir: Path
    logs: Path
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def secret(self) -> Path:
        return self.config.with_name("rank-secret-site1")

    def start(self) -> None:
        secret = self.secret
        secret.touch(mode=0o600)
        secret.write_text(os.urandom(32).hex())
        first = self.net.exec_prefix
        self._spawn(
            "coordinator",
            [*first, *CLI, "coordinator", "--config", str(self.config), "--site", "site1",
             "--listen", f"0.0.0.0:{COORDINATOR_PORT}", "--rank-secret-file", str(secret)],
            {},
        )  # fmt: skip
        self.start_ranks()

    def start_ranks(self) -> None:
        """One rank per node, as srun starts them (the coordinator already runs)."""
        secret, first = self.secret, self.net.exec_prefix
        hosts = [(first, self.net.address), *((n.exec_prefix, n.address) for n in self.net.nodes)]
        for rank, (prefix, address) in enumerate(hosts):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": "0",
                "MASTER_ADDR": self.net.lan_address, "MASTER_PORT": str(MASTER_PORT),
                "GLOO_SOCKET_IFNAME": LAN_IFNAME,  # the site's LAN, on every node
                "ISTHMUS_CONFIG": str(self.config), "ISTHMUS_RUN_DIR": str(self.run_dir),
                "ISTHMUS_SITE": "site1", "ISTHMUS_RANK_SECRET_FILE": str(secret),
                "ISTHMUS_COORDINATOR": f"{self.net.lan_address}:{COORDINATOR_PORT}",
                "ISTHMUS_ADVERTISE_HOST": address,
            }  # fmt: skip
            self._spawn(
                f"rank{rank}", [*prefix, sys.executable, "-m", "isthmus.deploy.rank.program"], env
            )

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / f"site1-{name}.log", "a")  # noqa: SIM115 - the child's
        env = {**os.environ, "no_grpc_proxy": "none.invalid", "PYTHONUNBUFFERED": "1", **env}
        self.processes.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env))
        log.close()

    @property
    def ranks(self) -> list[subprocess.Popen]:
        return self.processes[1:]

    def restart_ranks(self) -> None:
        """The nodes are back: what is left of the ranks ends, all start again, and
        the coordinator that outlived them stays."""
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
        del self.processes[1:]
        self.start_ranks()

    def failed(self) -> bool:
        """A rank died: kill what is left of the site, as srun and the trap would."""
        if not any(p.poll() not in (None, 0) for p in self.ranks):
            return False
        self.kill()
        return True

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.processes.clear()

    def tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("site1-*.log"))
        )


@pytest.fixture
def wan() -> Iterator[TransparentWan]:
    with root_wan("m", SPEC, [1, 2], "network namespaces and iptables") as wan:
        yield wan


def start_job(
    wan: TransparentWan, tmp_path: Path, job_dir: Path, steps: int, pace_s: float
) -> tuple[subprocess.Popen, MultiNodeSite]:
    site0, site1 = wan.sites
    job = tmp_path / "job.toml"
    job.write_text(
        "\n".join(
            [
                "[job]", f"steps = {steps}",
                "[topology]", "ranks_per_site = 2",
                "[model]", 'preset = "tiny"',
                "[train]", "batch_size = 4", "seq_len = 64",
                "[sync]", "timeout_s = 240",
                "[failover]", "failure_timeout_s = 2.0", "heartbeat_s = 0.25",
                "[run]", "digest_every = 2", "tensorboard = false", "metrics_port = -1",
                "eval_batches = 1",  # no test here reads the held-out loss
                # Beyond loopback: mutual TLS and the job token (docs/security.md).
                "[security]", "require_tls = true", "require_token = true",
                f'certs_dir = "{job_dir}"',
                "[cluster]", 'lane_host = "0.0.0.0"',
                f'coordinators = {{ site0 = "{site0.address}:{COORDINATOR_PORT}", '
                f'site1 = "{site1.address}:{COORDINATOR_PORT}" }}',
            ]
        )
        + "\n"
    )  # fmt: skip
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    # The template's one resolved config for site1's coordinator and ranks.
    config = tmp_path / "config-site1.toml"
    config.write_text(load_config(job, [f"cluster.advertise_host={site1.address}"]).to_toml())
    site1_procs = MultiNodeSite(site1, config, run_dir, logs)
    env = {**os.environ, "no_grpc_proxy": "none.invalid", "ISTHMUS_STEP_FLOOR_S": str(pace_s)}
    site1_procs.start()
    with open(logs / "site0.log", "w") as log:
        site0_proc = subprocess.Popen(
            [*site0.exec_prefix, *CLI, "site", "--config", str(job), "--site", "site0",
             "--run-dir", str(run_dir), "--quiet", "--set", f"cluster.advertise_host={site0.address}"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    return site0_proc, site1_procs


def wait_until(ready, what: str, site0: subprocess.Popen, site1: MultiNodeSite) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        assert site0.poll() is None, f"site0 exited with {site0.returncode} before {what}"
        assert time.monotonic() < deadline, f"no {what} in {DEADLINE_S} s:\n{site1.tail()}"
        time.sleep(0.2)


def finish(site0: subprocess.Popen, site1: MultiNodeSite, tmp_path: Path) -> list[dict]:
    """Both sites end: every rank's result, one parameter digest among them."""
    assert site0.wait(DEADLINE_S) == 0, (tmp_path / "logs" / "site0.log").read_text()[-3000:]
    for p in site1.ranks:
        assert p.wait(DEADLINE_S) == 0, site1.tail()
    results = [json.loads(p.read_text()) for p in (tmp_path / "run").glob("sites/*/rank*.json")]
    assert sorted((r["site"], r["rank"]) for r in results) == [
        (s, r) for s in ("site0", "site1") for r in (0, 1)
    ], results
    assert len({r["digest"] for r in results}) == 1, results
    return results


def test_a_node_lost_then_back_the_site_rejoins(wan, tmp_path, job_dir):
    """SIGKILL the second node's rank mid-run: site1 cannot step (its process group is
    broken) and goes down; site0 (the tie-breaker) trains on alone. Started again,
    site1 pulls site0's state and both end identical."""
    site0, site1 = start_job(wan, tmp_path, job_dir, steps=60, pace_s=0.4)
    metrics = tmp_path / "run" / "sites" / "site0" / "metrics.jsonl"
    try:
        wait_until(lambda: len(_records(metrics)) >= 4, "step 4", site0, site1)
        site1.ranks[1].kill()  # node 2 is lost
        wait_until(site1.failed, "end of site1", site0, site1)
        lost_at = len(_records(metrics))
        wait_until(
            lambda: sum(r.get("live_sites") == 1 for r in _records(metrics)) >= 3,
            "site0 step alone", site0, site1,
        )  # fmt: skip
        site1.start()  # the node is back: the whole site starts again
        finish(site0, site1, tmp_path)
    finally:
        site0.kill()
        site1.kill()
    records = _records(metrics)
    assert [r["step"] for r in records] == list(range(60)), "site0 skipped or repeated a step"
    alone = [r["step"] for r in records if r.get("live_sites") == 1]
    assert alone and alone[0] >= lost_at - 1, (alone, lost_at)
    assert records[-1]["live_sites"] == 2, records[-1]  # rejoined
    # The restarted site1's metrics begin after the loss: it pulled site0's state.
    steps1 = [r["step"] for r in _records(tmp_path / "run" / "sites" / "site1" / "metrics.jsonl")]
    assert steps1 and steps1[0] > lost_at and steps1 == list(range(steps1[0], 60)), steps1


def test_a_node_lost_while_its_coordinator_lives_the_job_goes_on_at_once(wan, tmp_path, job_dir):
    """SIGKILL the second node's rank and leave site1's coordinator up (srun without
    --kill-on-bad-exit): the coordinator notices its rank's silence
    (failover.failure_timeout_s, inter/control/rank_liveness.py) and site1 leaves, so
    site0 trains on alone after seconds, not after sync.timeout_s +
    failover.quorum_wait_s (540 s here) as before. The ranks started again rejoin
    under the same coordinator with site0's state; all four end identical.

    The same run shows that a site on two nodes trains across the emulated WAN only: a
    run of its own for that (3 steps, no loss) cost a whole job's start-up (namespaces,
    six processes importing torch) and showed nothing this one does not."""
    site0, site1 = start_job(wan, tmp_path, job_dir, steps=60, pace_s=0.4)
    metrics = tmp_path / "run" / "sites" / "site0" / "metrics.jsonl"
    try:
        wait_until(lambda: len(_records(metrics)) >= 4, "step 4", site0, site1)
        site1.ranks[1].kill()  # node 2 is lost
        wait_until(
            lambda: sum(r.get("live_sites") == 1 for r in _records(metrics)) >= 2,
            "site0 step alone", site0, site1,
        )  # fmt: skip
        assert site1.processes[0].poll() is None, site1.tail()  # the coordinator lives
        site1.restart_ranks()
        results = finish(site0, site1, tmp_path)
    finally:
        site0.kill()
        site1.kill()
    # Every lane byte crossed the emulated link: the relay forwarded at least what
    # each site's lanes sent (a rank's bytes_sent is its site's total; site1's counts
    # from its ranks' restart, site0's from the start, through the loss and the rejoin).
    sent = {r["site"]: r["bytes_sent"] for r in results if r["rank"] == 0}
    delivered = wan.links["site0-site1"].stats()
    assert sent["site0"] > 0 and sent["site1"] > 0, sent
    assert delivered["a_to_b"]["bytes_delivered"] >= sent["site0"], (delivered, sent)
    assert delivered["b_to_a"]["bytes_delivered"] >= sent["site1"], (delivered, sent)
    records = _records(metrics)
    assert [r["step"] for r in records] == list(range(60)), "site0 skipped or repeated a step"
    first = next(i for i, r in enumerate(records) if r.get("live_sites") == 1)
    # site0's wall time from the last step with site1 to its first step alone: the
    # dead rank's silence (2 s), its last poll (<= 1 s), a heartbeat (0.25 s), the
    # step run again alone (0.4 s), and a loaded 2-core machine's slack: 2.3 s seen.
    waited = records[first]["elapsed_s"] - records[first - 1]["elapsed_s"]
    assert waited < 10.0, (waited, records[first - 1 : first + 1])
    assert records[-1]["live_sites"] == 2, records[-1]  # rejoined
    steps1 = [r["step"] for r in _records(tmp_path / "run" / "sites" / "site1" / "metrics.jsonl")]
    assert steps1 and steps1[0] > first and steps1 == list(range(steps1[0], 60)), steps1
