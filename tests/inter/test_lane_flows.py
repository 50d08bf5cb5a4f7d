"""Connections per peer lane sized from the link, over a real per-flow-capped emulated
link; the bulk sockets' dead-peer timeouts (issue 32, item 2)."""

from __future__ import annotations

import socket
import subprocess

import pytest
import torch
from lanes import inputs, run_all, two_sites_over

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.launch.local import link_spec
from isthmus.inter.data.transport import bulk_stream
from isthmus.inter.data.transport.chunk_size import connections_for_link, tcp_receive_window
from isthmus.sim import LinkSpec

pytestmark = pytest.mark.timeout(120)


def test_connections_fill_the_link_past_a_per_flow_cap_and_a_window() -> None:
    window = 3 << 20
    # A cloud's 5 Gbit/s per flow on a 25 Gbit/s link: five flows, where one flow's
    # window (16 MiB) would carry 13 Gbit/s over 10 ms; ten where it carries 2.5.
    assert connections_for_link(25e9, 0.010, 5e9, window_bytes=16 << 20) == 5
    assert connections_for_link(25e9, 0.010, 5e9, window_bytes=window) == 10
    # No cap, 10 Gbit/s over 10 ms: 12.5 MB in flight, 3 MiB a connection: four.
    assert connections_for_link(10e9, 0.010, window_bytes=window) == 4
    # A short, slow link still gets two (one waits for acknowledgements, one sends).
    assert connections_for_link(1e9, 0.001, window_bytes=window) == 2
    # Never more than 16.
    assert connections_for_link(400e9, 0.1, 1e9, window_bytes=window) == 16
    with pytest.raises(ValueError):
        connections_for_link(1e9, 0.01, per_flow_bps=-1)


def test_the_window_is_read_from_the_kernel(tmp_path) -> None:
    rmem = tmp_path / "tcp_rmem"
    rmem.write_text("4096\t131072\t8388608\n")
    assert tcp_receive_window(str(rmem)) == 4 << 20
    assert tcp_receive_window(str(tmp_path / "missing")) == 3 << 20


def test_a_job_sizes_its_connections_from_wan_and_a_chosen_count_wins(monkeypatch) -> None:
    from isthmus.inter.data.transport import chunk_size

    monkeypatch.setattr(chunk_size, "tcp_receive_window", lambda: 16 << 20)  # any host's
    link = ["wan.distance_km=1000", "wan.bandwidth_mbit=25000", "wan.per_flow_mbit=5000"]
    assert load_config(overrides=link).lane_connections == 5
    assert load_config(overrides=[*link, "sync.connections=3"]).lane_connections == 3
    assert load_config(overrides=["wan.bandwidth_mbit=100"]).lane_connections == 2
    # isthmus local emulates the cap it sizes for.
    spec = link_spec(load_config(overrides=link))
    assert spec.a_to_b.per_flow_bps == spec.b_to_a.per_flow_bps == 5e9
    assert spec.a_to_b.bandwidth_bps == 25e9
    for bad, words in [
        ("wan.per_flow_mbit=-1", "wan.per_flow_mbit must be >= 0"),
        ("sync.connections=17", "sync.connections must be in 1..16, or 0"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(overrides=[bad])


def test_a_round_over_a_capped_link_opens_the_sized_connections_and_is_exact(
    monkeypatch,
) -> None:
    """Two sites through the emulator, 400 Mbit/s with 100 Mbit/s per flow: the lanes
    open four connections each way (the cap, not the window, decides), the link carries
    them, and the round is exact."""
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")
    n = connections_for_link(400e6, 0.002, 100e6)
    assert n == 4
    spec = LinkSpec.symmetric(latency_s=0.001, bandwidth_bps=400e6, per_flow_bps=100e6)
    with two_sites_over(spec, chunk_bytes=256 * 1024, connections=n, timeout_s=60) as (
        ars,
        servers,
        link,
    ):
        data = inputs(2, [1 << 20], seed=7)  # 4 MiB a site: 16 chunks, 8 each way
        want = data[0][0] + data[1][0]
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 1, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
        stats = link.stats()
        # Each direction: the lanes' bulk connections plus gRPC's channels (OpenBulk).
        assert stats["a_to_b"]["connections"] >= n
        assert stats["b_to_a"]["connections"] >= n
        # The listener's side of every bulk connection drops a vanished peer.
        conns = list(servers[0].bulk.conns)
        assert len(conns) == n
        for conn in conns:
            timeout = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
            assert timeout == int(bulk_stream.USER_TIMEOUT_S * 1000)
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


def test_a_job_its_hosts_cannot_hold_the_connections_of_is_refused_before_start(tmp_path):
    """Issue 61: 6 sites x 16 connections may take 752 open files a rank (its 16 to each
    of 5 peers, 32 from each, the rest). Under a hard limit of 700, `isthmus local`
    refuses it in one line before any process starts; a rank under a soft limit of 256
    raises its own to 752 when the hard limit lets it, and names both when not."""
    import resource
    import sys

    from helpers import assert_one_line_error, run_cli

    from isthmus.inter.data.transport.chunk_size import descriptors_needed

    assert descriptors_needed(5, 16) == 752

    def limit(n: int):
        return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    job = ["--sites", "6", "--ranks-per-site", "1", "--set", "sync.connections=16"]
    run = tmp_path / "run"
    refused = run_cli("local", "--run-dir", str(run), *job, timeout=60, preexec_fn=limit(700))
    assert_one_line_error(
        refused, "each rank may hold 752 open files", "hard limit is 700", "ulimit -Hn"
    )
    assert not (run / "sites").exists()  # nothing started
    # The same check, given the room, passes; the rank raises its own soft limit.
    script = (
        "import resource\n"
        "from isthmus.inter.data.transport.chunk_size import raise_descriptor_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))\n"
        "raise_descriptor_limit(752)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 700))\n"
        "raise_descriptor_limit(752)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["752"], done.stdout + done.stderr
    assert "OSError: this rank may need 752 open files" in done.stderr
    assert "the hard limit is 700" in done.stderr
