"""benchmarks/offload.py: one site with and without FSDP2 CPU offload, on CPU gloo."""

from __future__ import annotations

import json

import pytest
from helpers import load_benchmark, run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_offload_benchmark_runs_both_ways_and_offload_changes_no_loss(tmp_path):
    out = tmp_path / "offload.json"
    done = run_benchmark(
        *("offload", "--device", "cpu", "--gpus", "2"),
        *("--case", "tiny:2", "--seq", "64", "--batch", "2", "--steps", "2"),
        *("--json", str(out)),
        timeout=220,
    )
    logs = "\n".join(log.read_text()[-4000:] for log in tmp_path.glob("*.log"))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["offload"], r["fits"]) for r in rows] == [
        ("tiny:2", False, True),
        ("tiny:2", True, True),
    ]
    without, with_offload = rows
    assert with_offload["params"] == without["params"] > 0
    # On CPU offload moves nothing: the same arithmetic, the same loss bit for bit.
    assert with_offload["loss_last"] == without["loss_last"]
    assert "tiny:2" in done.stdout and "offload" in done.stdout


def test_the_offload_benchmark_refuses_a_malformed_case():
    done = run_benchmark("offload", "--case", "1b", timeout=120)
    assert done.returncode == 2
    assert "expected PRESET:LAYERS" in done.stderr


def test_a_failed_case_names_the_workers_own_error_not_only_torchruns_summary(tmp_path):
    """A worker that dies keeps its cause in the row: here a real torchrun whose worker
    aborts (SIGABRT, as a C++ `terminate` does), with the whole output beside the JSON."""
    bench = load_benchmark("offload")
    worker = tmp_path / "aborts.py"
    worker.write_text(
        "import os, sys\n"
        "print('terminate called after throwing an instance of gloo::IoException', "
        "file=sys.stderr, flush=True)\n"
        "os.abort()\n"
    )
    bench.SITE_STEP = worker
    args = bench.parse_args(["--device", "cpu", "--gpus", "1", "--case", "tiny:1",
                             "--json", str(tmp_path / "offload.json")])  # fmt: skip
    row = bench.run_case(args, "tiny:1", False)
    assert row["fits"] is None
    assert row["error"].startswith("terminate called after throwing an instance of gloo")
    assert "|| " in row["error"]  # then torchrun's own summary
    log = tmp_path / "offload-tiny-1-offload-False.log"
    assert "gloo::IoException" in log.read_text()
