"""Link traces (sim/trace.py): the file's rules, topology files naming one, and a live
link's spec following its rows over real sockets, in a relay, `isthmus wan up` and
`isthmus local`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, assert_one_line_error, run_cli, start_wan_up, wait_until
from sockets import Server, connect, serve_echo, sink_server

from isthmus.sim import Jitter, LinkSpec, Loss, RelayServer, control_request, load_topology
from isthmus.sim.netns import require_tools
from isthmus.sim.topology import apply_changes, parse_topology
from isthmus.sim.trace import at_row, load_trace
from isthmus.sim.transparent import TransparentWan

MBIT = 1e6
WAN = [sys.executable, "-m", "isthmus.deploy.commands.wan"]


def _file(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _traced(tmp_path: Path, text: str, **spec: float) -> LinkSpec:
    """A symmetric link (`spec`'s keyword arguments) that replays the trace `text`."""
    d = LinkSpec.symmetric(**spec).a_to_b
    d = dataclasses.replace(d, trace=load_trace(_file(tmp_path, text)))
    return LinkSpec(a_to_b=d, b_to_a=d)


def _trace_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("isthmus-trace")]


# -- the file --------------------------------------------------------------------------


def test_a_trace_is_a_step_function_of_its_rows(tmp_path) -> None:
    text = "\ufefft_s, bandwidth_mbit,latency_ms,loss,per_flow_mbit\n0,100,5,,\n\n0.5,10,,0.01,5\n"
    path = _file(tmp_path, text)
    trace = load_trace(path)
    assert trace.times == (0.0, 0.5)
    # An empty cell names nothing: that key keeps its value.
    assert trace.rows == (
        (("bandwidth_mbit", 100.0), ("latency_ms", 5.0)),
        (("bandwidth_mbit", 10.0), ("loss", 0.01), ("per_flow_mbit", 5.0)),
    )
    spec = LinkSpec.symmetric(latency_s=0.001, bandwidth_bps=1e9, impairments=(Jitter(ms=1),))
    d = dataclasses.replace(spec.a_to_b, trace=trace)
    first = at_row(d, 0)
    assert (first.bandwidth_bps, first.latency_s, first.impairments) == (
        100e6,
        0.005,
        d.impairments,
    )
    second = at_row(first, 1)
    assert (second.bandwidth_bps, second.latency_s, second.per_flow_bps) == (10e6, 0.005, 5e6)
    assert second.impairments == (Jitter(ms=1), Loss(rate=0.01))  # a loss is added last
    # A loss the link has keeps its other parameters; an unchanged rate leaves the chain
    # equal, so that the impairments do not restart.
    lossy = dataclasses.replace(d, impairments=(Loss(rate=0.5, delay_ms=200),))
    assert at_row(lossy, 1).impairments == (Loss(rate=0.01, delay_ms=200),)
    assert at_row(at_row(lossy, 1), 1).impairments == at_row(lossy, 1).impairments


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "is empty"),
        ("t_s,speed\n0,1\n", "line 1: unknown column 'speed'; columns: t_s, bandwidth_mbit"),
        ("bandwidth_mbit\n0\n", "line 1: name t_s and each other column once"),
        ("t_s,loss,loss\n0,0,0\n", "line 1: name t_s and each other column once"),
        ("t_s,loss\n", "has no rows under its header"),
        ("t_s,loss\n0.5,0\n", "line 2, column t_s: 0.5, but t_s starts at 0"),
        ("t_s,loss\n0,0\n1,0\n1,0\n", "line 4, column t_s: 1, but t_s increases"),
        ("t_s,latency_ms\n0,-1\n", "line 2, column latency_ms: '-1' must be a finite number >= 0"),
        ("t_s,latency_ms\n0,fast\n", "line 2, column latency_ms: 'fast' is not a number"),
        ("t_s,latency_ms\n0,nan\n", "'nan' must be a finite number"),
        ("t_s,loss\n0,1.5\n", "line 2, column loss: 1.5 is not in 0..1"),
        ("t_s,loss\n0,0\n1\n", "line 3: 1 cells, the header has 2"),
        ("t_s,loss\n,0\n", "line 2, column t_s: '' is not a number"),
    ],
)
def test_bad_trace_files_fail_naming_file_line_and_column(tmp_path, text, needle) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ValueError, match="^[^\n]+$") as info:
        load_trace(path)
    assert needle in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ValueError, match="trace file not found"):
        load_trace(tmp_path / "missing.csv")


# -- topology files --------------------------------------------------------------------


def test_the_example_drops_10_to_1_and_back() -> None:
    spec = load_topology(ROOT / "docs" / "topologies" / "two-sites-trace.toml").spec("east", "west")
    trace = spec.a_to_b.trace
    assert trace is not None and trace == spec.b_to_a.trace
    assert trace.times == (0, 30, 50)
    assert [dict(row)["bandwidth_mbit"] for row in trace.rows] == [10000, 1000, 10000]
    assert spec.a_to_b.bandwidth_bps == 10e9 and spec.rtt_s == pytest.approx(2 * 4.9e-3)


def test_topology_trace_keys_paths_and_live_changes(tmp_path) -> None:
    _file(tmp_path, "t_s,bandwidth_mbit\n0,50\n1,5\n", "slow.csv")
    (tmp_path / "sub").mkdir()
    _file(tmp_path / "sub", "t_s,latency_ms\n0,30\n", "far.csv")
    data = {
        "sites": ["a", "b", "c"],
        "defaults": {"latency_ms": 1, "bandwidth_mbit": 100, "trace": "slow.csv"},
        "links": {"a-b": {"b_to_a": {"trace": "sub/far.csv"}}},
    }
    topology = parse_topology(data, tmp_path)  # relative to the topology file's folder
    ab = topology.spec("a", "b")
    # The first row applies from the start; keys it does not name keep the file's value.
    assert (ab.a_to_b.bandwidth_bps, ab.a_to_b.latency_s) == (50e6, 0.001)
    assert (ab.b_to_a.bandwidth_bps, ab.b_to_a.latency_s) == (100e6, 0.030)
    assert topology.spec("a", "c").b_to_a.trace == ab.a_to_b.trace  # from [defaults]
    assert topology.spec("b", "a").a_to_b == ab.b_to_a  # oriented with its trace
    # A live change keeps the traces; a trace is not set on a live link.
    changed = apply_changes(ab, {"latency_ms": 7})
    assert changed.a_to_b.trace == ab.a_to_b.trace and changed.a_to_b.latency_s == 0.007
    with pytest.raises(ValueError, match="a trace is set in a topology file, not on a live"):
        apply_changes(ab, {"a_to_b": {"trace": "slow.csv"}})
    with pytest.raises(
        ValueError, match=r"links.a-b.a_to_b.trace must be a CSV file's name, got 3"
    ):
        parse_topology({**data, "links": {"a-b": {"trace": 3}}}, tmp_path)
    with pytest.raises(ValueError, match="trace file not found: .*nope.csv"):
        parse_topology({**data, "links": {"a-b": {"trace": "nope.csv"}}}, tmp_path)


# -- a live link -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_bandwidth_drop_holds_from_its_row(either_relay, tmp_path) -> None:
    """200 -> 20 Mbit/s at 0.4 s: once the link shows row 1, what it delivers over a
    window never exceeds the new rate's, plus what was in flight at the old rate."""
    spec = _traced(tmp_path, "t_s,bandwidth_mbit\n0,200\n0.4,20\n", latency_s=0.005)
    old = at_row(spec.a_to_b, 0)
    new = at_row(old, 1)
    control = either_relay.serve_control()
    with sink_server() as (_, server):
        link = either_relay.add_link("ab", spec)
        first = control_request(control.address, "GET", "/links/ab")
        if first["trace"]["a_to_b"]["now_s"] < 0.4:  # a row never applies early
            assert first["trace"]["a_to_b"]["row"] == 0, first
            assert first["spec"]["a_to_b"]["bandwidth_mbit"] == 200
        assert first["trace"]["a_to_b"]["next_s"] in (0.4, None)
        stop = threading.Event()

        def send() -> None:
            with connect(link.add_forward(*server.address)) as s:
                while not stop.is_set():
                    s.sendall(b"x" * 65536)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            shown = {}

            def changed() -> bool:
                shown.update(control_request(control.address, "GET", "/links/ab"))
                return shown["trace"]["a_to_b"]["row"] == 1

            wait_until(changed, "row 1 of the trace")
            assert shown["trace"]["a_to_b"]["now_s"] >= 0.4
            assert shown["trace"]["a_to_b"]["next_s"] is None
            assert shown["spec"]["a_to_b"]["bandwidth_mbit"] == 20
            assert shown["spec"]["b_to_a"]["bandwidth_mbit"] == 20
            t0 = time.monotonic()
            before = link.stats()["a_to_b"]["bytes_delivered"]
            time.sleep(0.5)
            after = link.stats()["a_to_b"]["bytes_delivered"]
            window = time.monotonic() - t0  # outside both readings: never shorter
            pieces = 2 * 64 * 1024  # one piece of each rate may straddle the window
            bound = new.bandwidth_bps * window / 8 + old.inflight_limit_bytes + pieces
            assert after - before <= bound, (after - before, bound, window)
        finally:
            stop.set()
            sender.join(10)


@pytest.mark.timeout(60)
def test_latency_and_loss_rows_lengthen_round_trips(either_relay, tmp_path) -> None:
    """1 -> 40 ms one way at 0.3 s, then every segment lost (a stall of the RTT each way)
    at 0.8 s: a ping sent once the link shows a row takes at least that row's round trip."""
    text = "t_s,latency_ms,loss\n0,1,0\n0.3,40,\n0.8,,1\n"
    spec = _traced(tmp_path, text, latency_s=0.010)
    echo = Server(serve_echo)
    try:
        link = either_relay.add_link("ab", spec)
        with connect(link.add_forward(*echo.address)) as s:
            row = 0
            while row < 2:
                with link.lock:  # the row and the spec it made, read together
                    row, spec_now = link.replay.position()["a_to_b"]["row"], link.spec
                t0 = time.monotonic()
                s.sendall(b"ping")
                assert s.recv(16) == b"ping"
                rtt = time.monotonic() - t0
                # Sent once the link showed `row`: at least its round trip (later rows'
                # are longer still).
                assert rtt >= 0.99 * (0.002, 0.080, 0.240)[row], (row, rtt)
                assert spec_now.a_to_b.latency_s == (0.001, 0.040, 0.040)[row]
                assert spec_now.a_to_b.impairments == ((), (), (Loss(rate=1.0),))[row]
            stats = link.stats()
            assert stats["a_to_b"]["lost_segments"] >= 1 and stats["b_to_a"]["stalls"] >= 1
    finally:
        echo.close()


@pytest.mark.timeout(30)
def test_a_set_wins_until_the_next_row_and_replays_end_with_the_link(tmp_path) -> None:
    spec = _traced(tmp_path, "t_s,bandwidth_mbit\n0,100\n1.5,50\n", latency_s=0.002)
    with RelayServer() as relay:
        link = relay.add_link("ab", spec)
        control = relay.serve_control().address
        control_request(control, "POST", "/links/ab", {"bandwidth_mbit": 10})
        # The set wins over the trace's key until the next row, and for good over the
        # keys the trace does not name (latency).
        with link.lock:
            row, now = link.replay.position()["a_to_b"]["row"], link.spec.a_to_b
        assert now.bandwidth_bps == (10e6, 50e6)[row]
        control_request(control, "POST", "/links/ab", {"latency_ms": 7})
        wait_until(lambda: link.spec.a_to_b.bandwidth_bps == 50e6, "row 1", 10)
        assert link.spec.a_to_b.latency_s == 0.007 and link.spec.b_to_a.latency_s == 0.007
        wait_until(lambda: not _trace_threads(), "the replay's thread ends after its last row")
        # A spec with another trace starts it from its first row; one without ends it.
        link.update(_traced(tmp_path, "t_s,bandwidth_mbit\n0,30\n60,40\n", latency_s=0.002))
        assert link.spec.a_to_b.bandwidth_bps == 30e6 and _trace_threads()
        link.update(_traced(tmp_path, "t_s,bandwidth_mbit\n0,30\n60,40\n", latency_s=0.002))
        assert len(_trace_threads()) == 1  # the same trace: replayed on, not restarted
        link.update(LinkSpec.symmetric(latency_s=0.002))
        wait_until(lambda: not _trace_threads(), "a replaced replay's thread ends")
        assert link.replay is None
        link.update(_traced(tmp_path, "t_s,bandwidth_mbit\n0,30\n60,40\n", latency_s=0.002))
    assert not _trace_threads()  # closing the relay ends its replays


@pytest.mark.timeout(60)
def test_wan_up_replays_a_topology_trace(tmp_path) -> None:
    _file(tmp_path, "t_s,bandwidth_mbit\n0,40\n0.5,20\n")
    topology = tmp_path / "topology.toml"
    topology.write_text(
        'sites = ["a", "b"]\n[links."a-b"]\nlatency_ms = 2\nbandwidth_mbit = 100\n'
        'a_to_b.trace = "trace.csv"\n'
    )
    up, lines = start_wan_up(topology)
    try:
        control = next(line.split()[1] for line in lines if line.startswith("control"))
        assert "a -> b  2 ms, 40 Mbit/s" in "\n".join(lines)  # the first row, from the start

        def show() -> dict:
            shown = subprocess.run(
                [*WAN, "show", "--json", "--control", control],
                capture_output=True,
                text=True,
                timeout=20,
            )
            assert shown.returncode == 0, shown.stderr
            return json.loads(shown.stdout)["a-b"]

        wait_until(lambda: show()["trace"]["a_to_b"]["row"] == 1, "row 1 through wan show")
        link = show()
        assert link["spec"]["a_to_b"]["bandwidth_mbit"] == 20
        assert link["spec"]["b_to_a"]["bandwidth_mbit"] == 100 and "b_to_a" not in link["trace"]
        refused = subprocess.run(
            [*WAN, "set", "--control", control, "a-b", "a_to_b.trace='x.csv'"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert_one_line_error(refused, "a trace is set in a topology file")
    finally:
        up.terminate()
        up.wait(20)


@pytest.mark.slow  # the real CLI end to end, as tests/e2e
@pytest.mark.timeout(300)
def test_isthmus_local_trains_to_identical_replicas_while_the_link_changes(tmp_path) -> None:
    """The link alternates 10 and 1 Gbit/s (and 1 and 3 ms) every 0.1 s for 5 minutes:
    every step's rounds cross a link that changes under them."""
    rows = [f"{i / 10:g},{10000 if i % 2 == 0 else 1000},{1 + 2 * (i % 2)}" for i in range(3000)]
    _file(tmp_path, "t_s,bandwidth_mbit,latency_ms\n" + "\n".join(rows) + "\n")
    topology = tmp_path / "topology.toml"
    topology.write_text(
        'sites = ["site0", "site1"]\n[links."site0-site1"]\nlatency_ms = 1\n'
        'bandwidth_mbit = 10000\ntrace = "trace.csv"\n'
    )
    run_dir = tmp_path / "run"
    result = run_cli(
        *("local", "--topology", str(topology), "--ranks-per-site", "1", "--steps", "4"),
        *("--set", "model.preset=tiny", "--set", "train.seq_len=64"),
        *("--set", "run.eval_batches=1", "--run-dir", str(run_dir)),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and len(set(summary["digests"].values())) == 1
    assert "replicas            identical" in result.stdout
    # The steps took longer than a row (load only lengthens them): the link changed
    # while they ran.
    assert summary["compute_s"] + summary["cross_site_s"] > 0.1


ECHO = r"""
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
conn = s.accept()[0]
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(1 << 16):
    conn.sendall(data)
"""
PINGS = r"""
import socket, sys, time
def ping(c):
    t = time.perf_counter()
    c.sendall(b"x")
    assert c.recv(1) == b"x"
    return time.perf_counter() - t
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as c:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(min(ping(c) for _ in range(5)))
"""


@pytest.mark.timeout(60)
def test_transparent_mode_replays_a_trace(tmp_path) -> None:
    """Sites in network namespaces (root and iptables, as tests/sim/test_netns.py): the
    link's latency row holds for an unmodified program's round trips."""
    require_tools()
    spec = _traced(tmp_path, "t_s,latency_ms\n0,1\n0.3,30\n", latency_s=0.005)
    with TransparentWan(f"tr{os.getpid() % 100000}", 2, spec) as wan:
        link = wan.links["site0-site1"]
        wait_until(lambda: link.replay.position()["b_to_a"]["row"] == 1, "row 1")
        server = subprocess.Popen(
            [*wan.sites[1].exec_prefix, sys.executable, "-c", ECHO, "7000"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            pings = subprocess.run(
                [
                    *wan.sites[0].exec_prefix,
                    sys.executable,
                    "-c",
                    PINGS,
                    wan.sites[1].address,
                    "7000",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
        finally:
            server.kill()
            server.wait()
        assert pings.returncode == 0, pings.stderr
        assert float(pings.stdout) >= 0.99 * 0.060
        assert link.spec.a_to_b.latency_s == 0.030
