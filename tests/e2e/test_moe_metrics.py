"""End to end: a mixture of experts' load statistics reach metrics.jsonl (issue 36)."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

pytestmark = pytest.mark.slow


@pytest.mark.timeout(150)
def test_a_capacity_bound_moe_run_reports_its_load_and_drops(tmp_path):
    """One rank, two steps of moe-tiny with a capacity: every step's line carries the
    load-balancing loss, the busiest expert's load over the mean and the dropped share,
    each the mean over the layers."""
    run_dir = tmp_path / "run"
    result = run_cli(
        "local",
        *("--sites", "1", "--ranks-per-site", "1", "--steps", "2", "--run-dir", str(run_dir)),
        *("--set", "model.preset=moe-tiny", "--set", "model.capacity_factor=1.0"),
        *("--set", "train.seq_len=32", "--set", "train.batch_size=4"),
        *("--set", "run.eval_batches=0", "--set", "run.tensorboard=false"),
        timeout=130,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        # 4 experts, top-2: the loss is 1 when balanced and below n_experts; the load
        # ratio at least 1 and at most n_experts / top_k; capacity 1.0 drops some
        # copies whenever an expert is above the mean, never most of them.
        assert 1.0 <= line["moe_aux_loss"] < 4.0, line
        assert 1.0 < line["moe_load_ratio"] <= 2.0, line
        assert 0.0 < line["moe_dropped"] < 0.5, line
