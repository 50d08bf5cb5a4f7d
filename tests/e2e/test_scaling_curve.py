"""benchmarks/scaling_curve.py end to end on the CPU: real `isthmus local` runs of one
site and two sites, tabulated next to the planning model (the same
script makes the GPU headline, benchmarks/gpu_runs.sh headline)."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import run_benchmark

pytestmark = pytest.mark.slow


def curve(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("scaling_curve", *args, timeout=400)


@pytest.mark.timeout(420)
def test_curve_of_one_site_against_two(tmp_path):
    out = tmp_path / "curve"
    args = ["--out", str(out), "--batches", "2", "--preset", "tiny", "--seq", "32"]
    args += ["--ranks-per-site", "1", "--steps", "4", "--warmup", "1", "--codec", "int8"]
    result = curve(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "scaling_curve.json").read_text())
    assert (data["preset"], data["sites"], data["codec"]) == ("tiny", 2, "int8")
    # One batch: every row is two whole `isthmus local` runs (~15 s each on 2 cores).
    assert [r["batch"] for r in data["rows"]] == [2]
    for r in data["rows"]:
        assert r["replicas_identical"], r
        assert r["steady_steps"] == 3  # 4 steps, the first left out
        assert r["one_site_tokens_per_s"] > 0 and r["multi_site_tokens_per_s"] > 0
        assert r["scaling_efficiency"] == pytest.approx(
            r["multi_site_tokens_per_s"] / (2 * r["one_site_tokens_per_s"])
        )
        # int8 across sites; every step's rounds ran, and the step waited for some of it.
        assert r["compression_ratio"] == pytest.approx(4.0, rel=0.02)
        assert r["sync_busy_s_per_step"] > 0 and r["exposed_sync_s_per_step"] >= 0
        assert 0 <= r["overlap"] <= 1
        assert 0 < r["predicted_efficiency"] <= 1 and r["predicted_exposed_sync_s"] > 0
        assert r["predicted_limit"] in ("link", "latency", "cpu")
        assert r["one_site_run_s"] > 0 and r["multi_site_run_s"] > 0
    lines = result.stdout.splitlines()
    assert "2-site tok/s" in lines[0] and "plan eff." in lines[0]
    assert lines[1].split()[:3] == ["2", "x", "32"]

    # Finished runs are read, not run again: the table comes back the same.
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")}
    again = curve(*args, "--tabulate-only")
    assert again.returncode == 0, again.stderr
    assert again.stdout == result.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")} == stamps
    # Runs are named by their arguments: other settings never reuse them.
    other = curve(*args, "--tabulate-only", "--set", "train.lr=0.001")
    assert other.returncode == 1 and "no batch has both runs" in other.stderr
