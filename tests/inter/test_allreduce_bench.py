"""The all-reduce benchmark: `--quick` runs end to end and writes valid JSON."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, load_benchmark

from isthmus.inter.data import bench
from isthmus.inter.data.bench import BenchCase, link_bound_s

SCRIPT = ROOT / "benchmarks" / "allreduce.py"


# Each run of the benchmark starts a process per lane and emulated links; on a loaded
# 2-core machine one took 150+ s (30-60 s quiet). Deadlines here only catch a hang: they
# are wide enough that load never decides a test (the figures live in docs/benchmarks/lanes.md).
SCRIPT_DEADLINE_S = 300


def _script(*args: str, timeout: float = SCRIPT_DEADLINE_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_link_bound() -> None:
    case = BenchCase(sites=2, rtt_ms=10, gbit=1, mib=256, codec="raw", chunk_bytes=1 << 20)
    # 2(S-1)/S x 256 MiB at 1 Gbit/s, plus one RTT.
    assert link_bound_s(case) == pytest.approx(256 * 2**20 * 8 / 1e9 + 0.010)
    three = BenchCase(sites=3, rtt_ms=0, gbit=10, mib=64, codec="raw", chunk_bytes=1 << 20)
    assert link_bound_s(three) == pytest.approx(4 / 3 * 64 * 2**20 * 8 / 10e9)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--sites", "1"], "--sites"),
        (["--codec", "lz4"], "--codec"),
        (["--gbit", "x"], "--gbit"),
        (["--lanes", "0"], "--lanes"),
        (["--warmup", "-1"], "--warmup"),
        (["--queue-kib", "-2"], "--queue-kib"),
        (["--lanes", "2", "--links", "3"], "--links"),
        (["--lanes", "2", "--links", "2", "--direct"], "--links"),
    ],
)
def test_bad_flags_are_one_line_errors(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The script's main in this process: its flags are checked before any work, and a
    # process of its own spent 3-4 s importing torch first (the script as a process:
    # test_quick_grid_writes_json).
    try:
        code = load_benchmark("allreduce").main(["--quick", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    stderr = capsys.readouterr().err
    assert code == 2 and "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], stderr


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_DEADLINE_S + 60)
def test_quick_grid_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = _script("--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "enc MB/s/core" in result.stdout and "effic." in result.stdout
    data = json.loads(out.read_text())
    assert {r["codec"] for r in data["codec_throughput"]} == {"raw", "int8+zstd:1"}
    assert len(data["cases"]) == 2
    for case in data["cases"]:
        assert case["identical"] and case["wall_s"] > 0 and case["efficiency"] > 0
        assert case["chunk_bytes"] == 256 * 1024  # 1 ms x 1 Gbit/s is below the floor
        assert case["cpu_s_per_gb"] > 0
    ratios = {c["codec"]: c["compression_ratio"] for c in data["cases"]}
    assert ratios["raw"] == pytest.approx(1.0) and ratios["int8+zstd:1"] > 3.5


@pytest.mark.timeout(SCRIPT_DEADLINE_S + 60)
def test_several_lanes_per_site_split_the_tensor_and_agree(tmp_path: Path) -> None:
    """2 sites x 2 lanes: each lane all-reduces its half with the same rank of the other
    site over the pair's one link; every half ends identical at both sites."""
    out = tmp_path / "bench.json"
    result = _script(
        "--quick", "--lanes", "2", "--codec", "raw", "--no-throughput", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    (case,) = json.loads(out.read_text())["cases"]
    assert case["lanes"] == 2 and case["identical"]
    details = case["sites_detail"]
    assert len(details) == 4
    # Lane 0 and lane 1 hold different halves; each half's bits agree across sites.
    assert details[0]["digest"] == details[2]["digest"] != details[1]["digest"]
    assert sum(d["raw_bytes"] for d in details) > 0


@pytest.mark.timeout(SCRIPT_DEADLINE_S + 60)
def test_lanes_over_several_links_move_more_than_one_link_carries(tmp_path: Path) -> None:
    """2 sites x 2 lanes over 2 links of 20 Mbit/s (`--links 2`): lane k crosses link k,
    so a site's bytes arrive faster than one link could carry them, and every half still
    ends identical at both sites."""
    # One link carries a site's bytes in `one_link_s` at the least, whatever the load (the
    # emulator's ceiling); two in half that, and load only lengthens it. So a wall time
    # under 0.9 x one link's tells two links from one on any machine that gives the lanes
    # 56 % of their rate; an attempt short of that is run again (up to 3), and a case
    # faster than its links (utilization over 1) fails on every one.
    walls: list[tuple[float, float]] = []
    for attempt in range(3):
        out = tmp_path / f"bench{attempt}.json"
        result = _script(
            "--sites", "2", "--rtt-ms", "1", "--gbit", "0.02", "--mib", "4", "--codec", "raw",
            "--lanes", "2", "--links", "2", "--warmup", "0", "--no-throughput",
            "--json", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        (case,) = json.loads(out.read_text())["cases"]
        assert case["links"] == 2 and case["identical"]
        details = case["sites_detail"]
        site_bytes = max(details[0]["bytes_sent"] + details[1]["bytes_sent"],
                         details[2]["bytes_sent"] + details[3]["bytes_sent"])  # fmt: skip
        one_link_s = site_bytes * 8 / 20e6  # the emulator holds one link to 20 Mbit/s
        assert one_link_s > 1.5
        # The bound and the utilization count both links.
        assert case["link_bound_s"] == pytest.approx(4 * 2**20 * 8 / 40e6 + 0.001)
        assert 0 < case["link_utilization"] <= 1.05, case["link_utilization"]
        walls.append((case["wall_s"], one_link_s))
        if case["wall_s"] < 0.9 * one_link_s:
            break
    assert walls[-1][0] < 0.9 * walls[-1][1], walls


@contextlib.contextmanager
def _links_of_falling_rate(num_sites: int, rtt_s: float, bandwidth_bps: float, links: int):
    """Like the benchmark's emulated links, but link k of a pair runs at 1 / 4**k of
    ``bandwidth_bps``: lanes that cross different links take steps of different lengths."""
    from isthmus.sim import LinkSpec, RelayServer

    relay = RelayServer().start()
    try:
        proxies: dict[tuple[int, int], list[str]] = {}
        for k in range(links):
            rate = bandwidth_bps / 4**k
            link = relay.add_link(
                f"l{k}", LinkSpec.symmetric(latency_s=rtt_s / 2, bandwidth_bps=rate)
            )
            for i, j, side in ((0, 1, "a"), (1, 0, "b")):
                host, port = link.add_proxy(initiator=side)
                proxies.setdefault((i, j), []).append(f"http://{host}:{port}")
        yield proxies
    finally:
        relay.close()


@pytest.mark.timeout(SCRIPT_DEADLINE_S + 60)
def test_every_lane_begins_each_step_together_and_the_slowest_times_it() -> None:
    """2 sites x 2 lanes, lane 0 over a link 4x faster than lane 1's. Each timed step
    begins on every lane within a few ms (as a site's ranks begin a step together in
    training), so the fast lane cannot run ahead into its next step and share out the
    time; the case's time is its median step's slowest lane."""
    case = BenchCase(
        sites=2, rtt_ms=1, gbit=0.04, mib=2, codec="raw", chunk_bytes=256 << 10,
        connections=2, lanes=2, links=2, warmup=1, repeats=3,
    )  # fmt: skip
    result = bench.run_case(case, _links_of_falling_rate)
    assert result["identical"]
    lanes = result["sites_detail"]
    slow_s = min(s["wall_s"] for s in lanes[1]["steps"])  # 1 MiB at 10 Mbit/s: ~0.84 s
    fast_s = sorted(s["wall_s"] for s in lanes[0]["steps"])[case.repeats // 2]
    # The links differ 4x in rate (0.21 s against 0.84 s quiet); a loaded host
    # stretches the fast lane's CPU-bound step towards the slow one's (0.76 against
    # 0.84 once beside two busy loops), so only their order is held here.
    assert fast_s < slow_s, (fast_s, slow_s)
    for k in range(case.repeats):
        began = [lane["steps"][k]["began"] for lane in lanes]
        # Without the barrier, the fast lane began step k about k x (slow - fast) early
        # (0.6 s a step on a quiet machine); together, within a wake-up's delay. A
        # quarter of the slow step is past the one and short of the other, and load
        # stretches it with the wake-ups.
        assert max(began) - min(began) < 0.25 * slow_s, (k, began, fast_s, slow_s)
    # Each lane's process froze its imports' objects out of the collector, as a rank
    # does, and says how long each step spent in it.
    assert all(lane["gc_frozen"] > 10_000 for lane in lanes)
    assert all(0 <= s["gc_s"] < s["wall_s"] for lane in lanes for s in lane["steps"])
    walls = result["step_walls_s"]
    assert walls == [max(lane["steps"][k]["wall_s"] for lane in lanes) for k in range(3)]
    assert result["wall_s"] == sorted(walls)[1]


def test_the_collector_clock_counts_a_collection() -> None:
    clock = bench.CollectorClock()
    try:
        for _ in range(20_000):
            a: list = []
            a.append(a)  # a cycle: only the collector frees it
        gc.collect()
        assert clock.total_s > 0
    finally:
        gc.callbacks.remove(clock.note)


def test_a_case_is_timed_by_one_step_not_by_each_lane_median() -> None:
    """Lanes whose own median steps are different steps: the case takes the step whose
    slowest lane is the median, and reads its bytes and time from that one step."""
    case = BenchCase(sites=2, rtt_ms=0, gbit=1, mib=8, codec="raw", chunk_bytes=1 << 20, repeats=3)

    def step(wall: float) -> dict[str, float]:
        return {
            "wall_s": wall, "sync_s": wall, "cpu_s": 0.1, "compute_s": 0.0,
            "exposed_s": wall, "bytes_sent": 2**23, "raw_bytes": 2**23,
            "corrupt_chunks": 0, "stalled_flows": 0,
        }  # fmt: skip

    walls = ([0.2, 0.1, 0.1], [0.1, 0.2, 0.1])  # each lane's median is 0.1 s
    reports = [{"digest": "d", "steps": [step(w) for w in ws]} for ws in walls]
    result = bench.summarize(case, reports)
    assert result["step_walls_s"] == [0.2, 0.2, 0.1]
    assert result["wall_s"] == 0.2  # the median step; each lane's own median said 0.1
    assert result["link_utilization"] == pytest.approx(2**23 * 8 / 1e9 / 0.2)


@pytest.mark.timeout(SCRIPT_DEADLINE_S + 60)
def test_with_tls_the_lanes_run_mutual_tls_and_agree(tmp_path: Path) -> None:
    """`--tls`: certificates are made for the run and every lane runs mutual TLS (chunks
    on the bulk port inside TLS); the sites still end identical, the JSON says so, and
    no certificate folder is left behind."""
    out = tmp_path / "bench.json"
    result = _script("--quick", "--tls", "--codec", "raw", "--no-throughput", "--json", str(out))
    assert result.returncode == 0, result.stderr
    (case,) = json.loads(out.read_text())["cases"]
    assert case["tls"] is True and case["identical"] and "certs_dir" not in case


@pytest.mark.timeout(3 * SCRIPT_DEADLINE_S + 60)  # three runs of the script
def test_warmup_steps_are_full_rounds_left_out_of_the_timing(tmp_path: Path) -> None:
    """`--warmup 2 --repeats 1` runs the same three full-size rounds as `--warmup 0
    --repeats 3` (int8's error feedback makes every step change the bits, so the final
    digests match only if the warm-up rounds really ran), and reports one timed step."""
    digests = {}
    for warmup, repeats in ((0, 3), (2, 1)):
        out = tmp_path / f"w{warmup}.json"
        result = _script(
            "--quick", "--codec", "int8", "--no-throughput", "--warmup", str(warmup),
            "--repeats", str(repeats), "--json", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        (case,) = json.loads(out.read_text())["cases"]
        assert case["identical"] and (case["warmup"], case["repeats"]) == (warmup, repeats)
        digests[warmup] = case["sites_detail"][0]["digest"]
    assert digests[0] == digests[2]
    short = tmp_path / "short.json"
    result = _script(
        "--quick", "--codec", "int8", "--no-throughput", "--warmup", "0", "--json", str(short)
    )
    assert result.returncode == 0, result.stderr
    (case,) = json.loads(short.read_text())["cases"]
    assert case["sites_detail"][0]["digest"] != digests[0]  # one step leaves other bits


@pytest.mark.timeout(60)
def test_host_cpu_counts_a_busy_core_over_a_case_rounds(tmp_path: Path) -> None:
    """benchmarks/host_cpu.py samples /proc/stat while a process spins on one core, and
    `annotate` averages the samples of a case's last rounds into its JSON."""
    import time

    samples = tmp_path / "cpu.txt"
    sampler = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "host_cpu.py"), "sample", str(samples)]
    )
    try:
        start = time.time()
        spin = "import time\nt = time.time()\nwhile time.time() - t < 2.5: pass"
        subprocess.run([sys.executable, "-c", spin], check=True, timeout=30)
        end = time.time()
    finally:
        sampler.kill()
        sampler.wait()
    # A case whose 5 rounds of 0.3 s ended 0.7 s before its processes did.
    detail = {"sync_s": 1.5, "wall_s": 1.5, "bytes_sent": 10**9}  # 5.33 Gbit/s
    case = {
        "cases": [
            {
                "warmup": 2, "repeats": 3, "wall_s": 0.3, "lanes": 1, "links": 1,
                "sites": 2, "connections": 2, "gbit": 10.66, "link_utilization": 0.5,
                "goodput_mb_s": 1000.0, "cpu_s_per_gb": 1.0, "identical": True,
                "tensor_bytes": 3 * 10**8,
                "sites_detail": [detail, detail],
            }
        ]
    }  # fmt: skip
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    line = load_benchmark("host_cpu").annotate(str(path), str(samples), start, end)
    busy = json.loads(path.read_text())["cases"][0]["host_busy_cores_rounds"]
    assert busy is not None and busy >= 0.8, (busy, samples.read_text())
    assert "a site sends 5.3 Gbit/s" in line and f"host busy {busy:.1f} cores" in line
    # 1 CPU-s per GB x 0.3 GB x 2 sites in a step of 0.3 s: the lanes took 2 cores.
    assert "(lanes 2.0)" in line
