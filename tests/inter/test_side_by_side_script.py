"""`benchmarks/allreduce_side_by_side.sh`: one allreduce case, the old tree against this one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce_side_by_side.sh"
TINY = ["--direct", "--sites", "2", "--rtt-ms", "1", "--gbit", "1", "--mib", "1",
        "--codec", "raw", "--lanes", "1", "--warmup", "0", "--repeats", "1",
        "--no-throughput"]  # fmt: skip


@pytest.mark.timeout(180)
def test_the_old_run_imports_the_old_tree_and_the_new_run_this_one(tmp_path: Path) -> None:
    # An old tree whose isthmus.inter will not import: its run fails (so it did not run
    # this tree's), the script says so and goes on, and this tree's run writes its figures.
    old, out = tmp_path / "old-tree", tmp_path / "out"
    (old / "inter").mkdir(parents=True)
    (old / "inter" / "__init__.py").write_text('raise ImportError("the old tree was imported")')
    done = subprocess.run(
        ["bash", str(SCRIPT), str(old), "tiny", *TINY],
        env={**os.environ, "OUT": str(out), "PAIRS": "1"},
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "== tiny, old, pair 1\n   (no table row: see above)" in done.stdout, done.stdout
    assert "ImportError: the old tree was imported" in done.stderr
    assert "== tiny, new, pair 1" in done.stdout
    assert not (out / "tiny-old-1.json").exists()
    case = json.loads((out / "tiny-new-1.json").read_text())["cases"][0]
    assert case["identical"] and case["sites"] == 2 and case["goodput_mb_s"] > 0


def test_without_a_name_it_says_how_to_call_it(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode != 0
    assert "usage:" in done.stderr and "OLD_TREE NAME" in done.stderr
