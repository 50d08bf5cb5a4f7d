"""`isthmus host-agent` (deploy/commands/host_agent.py), the agent the Slurm multi-node
template runs on each node: the real command against a real coordinator on loopback,
its ranks played by real ``CoordinatorClient``s."""

from __future__ import annotations

import signal
import stat
import subprocess
import threading

import pytest
from helpers import ISTHMUS, register_rank

from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.coordinator_client import CoordinatorClient, Verdict

pytestmark = pytest.mark.timeout(90)

FP = {"job.seed": "0"}


def test_the_command_serves_a_nodes_ranks_on_a_private_socket_and_cleans_up(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[topology]\nsites = 1\nranks_per_site = 2\n")
    coord = Coordinator(
        CoordinatorSettings(site="site0", site_names=["site0"], ranks=2, fingerprint=FP)
    )
    coord.start()
    socket_dir = tmp_path / "agent-dir"
    agent = None
    clients = []
    try:
        for rank in range(2):
            key = coord.rank_keys.handed(rank)
            register_rank(coord.address, "site0", FP, key=key, rank=rank, world_size=2)
        coord.wait_ready(10)
        agent = subprocess.Popen(
            [
                *ISTHMUS,
                *("host-agent", "--config", str(job), "--site", "site0"),
                *("--coordinator", coord.address, "--socket-dir", str(socket_dir)),
                # Told 4 ranks, it has 2 on this node: it waits for the 2 that watch
                # through it, not 250 ms for 2 that never come.
                *("--ranks", "4"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = agent.stdout.readline()
        assert line.startswith("host agent of site0 listening on unix:"), (
            line + agent.stderr.read() if agent.poll() is not None else line
        )
        address = line.rsplit(" ", 1)[1].strip()
        assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
        clients = [
            CoordinatorClient.connect(
                coord.address, rank_key=coord.rank_keys.handed(r), agent=address
            )
            for r in range(2)
        ]
        for client in clients:  # each rank watches before it votes, as SiteMembership does
            assert (
                client.membership_now(known_generation=1, wait_ms=0, timeout_s=10).generation == 1
            )
        decisions = {}

        def vote(rank: int) -> None:
            decisions[rank] = clients[rank].commit_step(
                site="site0", rank=rank, step=0, generation=1, ok=True, wait_ms=3_000, timeout_s=10
            )

        threads = [threading.Thread(target=vote, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert {d.verdict for d in decisions.values()} == {Verdict.COMMIT}
        assert all(c.agent_misses == 0 for c in clients)
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, err
        assert "'votes': 2, 'vote_messages': 1" in out
        assert not socket_dir.exists()
    finally:
        for client in clients:
            client.close()
        if agent is not None and agent.poll() is None:
            agent.kill()
        coord.stop(grace_s=0)


def test_a_socket_dir_that_exists_is_refused_in_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[topology]\nsites = 1\n")
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o777)
    (planted / "agent").write_text("someone else's")
    result = subprocess.run(
        [
            *ISTHMUS,
            *("host-agent", "--config", str(job), "--site", "site0"),
            *("--coordinator", "127.0.0.1:1", "--socket-dir", str(planted)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --socket-dir") and "exists" in last
    assert (planted / "agent").read_text() == "someone else's"  # nothing of it changed


def test_the_agent_exits_and_cleans_up_once_its_ranks_are_gone(tmp_path):
    """Under a scheduler the step's SIGTERM may come with a SIGKILL soon after: the agent
    leaves on its own once no rank watches through it, its folder removed."""
    job = tmp_path / "job.toml"
    job.write_text("[topology]\nsites = 1\nranks_per_site = 1\n")
    coord = Coordinator(
        CoordinatorSettings(site="site0", site_names=["site0"], ranks=1, fingerprint=FP)
    )
    coord.start()
    socket_dir = tmp_path / "agent-dir"
    agent = None
    try:
        register_rank(coord.address, "site0", FP, key=coord.rank_keys.handed(0))
        coord.wait_ready(10)
        agent = subprocess.Popen(
            [
                *ISTHMUS,
                *("host-agent", "--config", str(job), "--site", "site0"),
                *("--coordinator", coord.address, "--socket-dir", str(socket_dir)),
                *("--exit-after-s", "1"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        address = agent.stdout.readline().rsplit(" ", 1)[1].strip()
        client = CoordinatorClient.connect(
            coord.address, rank_key=coord.rank_keys.handed(0), agent=address
        )
        try:
            for _ in range(2):
                now = client.membership_now(known_generation=1, wait_ms=500, timeout_s=10)
                assert now.generation == 1
        finally:
            client.close()
        out, _ = agent.communicate(timeout=30)  # no signal: it ends by itself
        assert agent.returncode == 0
        assert "no rank watches any more, exiting" in out
        assert not socket_dir.exists()
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        coord.stop(grace_s=0)
