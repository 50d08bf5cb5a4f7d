"""`isthmus report` on a real run directory."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_one_line_error, run_cli

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_report_draws_plausible_plots_of_a_real_run(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_cli(
        "local", "--steps", "6", "--set", "model.preset=tiny", "--run-dir", str(run_dir), "--quiet"
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    result = run_cli("report", str(run_dir), timeout=120)
    assert result.returncode == 0, result.stderr
    import matplotlib.image

    for name in ("loss.png", "step_time.png", "wan_goodput.png", "loss_vs_cost.png"):
        image = matplotlib.image.imread(run_dir / name)
        height, width = image.shape[:2]
        assert (width, height) == (700, 400), name
        # Not blank: a plot has white background and enough drawn (coloured) pixels.
        rgb = image[..., :3]
        drawn = np.mean(np.any(rgb < 0.9, axis=-1))
        assert 0.02 < drawn < 0.6, (name, drawn)
        coloured = np.mean(rgb.max(axis=-1) - rgb.min(axis=-1) > 0.2)
        assert coloured > 0.005, (name, coloured)
    # TensorBoard event files carry the same numbers as metrics.jsonl.
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for site in ("site0", "site1"):
        board = EventAccumulator(str(run_dir / "tensorboard" / site))
        board.Reload()
        losses = [e.value for e in board.Scalars("train/loss")]
        lines = (run_dir / "sites" / site / "metrics.jsonl").read_text().splitlines()
        expected = [json.loads(line)["loss"] for line in lines]
        assert losses == pytest.approx(expected, rel=1e-6)
        assert len(board.Scalars("time/cross_site_seconds")) == 6
        exposed = [e.value for e in board.Scalars("time/exposed_sync_seconds")]
        assert exposed == pytest.approx([json.loads(x)["exposed_sync_s"] for x in lines], rel=1e-6)
        assert len(board.Scalars("time/sync_busy_seconds")) == 6
    text = (run_dir / "report.txt").read_text()
    assert "6 steps" in text and "replicas: identical" in text
    assert "of the 1,000 Mbit/s link" in text
    assert "cross-site rounds ran" in text and "behind compute" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"{summary['bytes_per_token']:,.1f} per token" in text
    assert summary["sync_mode"] == "step" and summary["outer_steps"] == 0
    assert text in result.stdout + "\n"


def test_report_of_a_folder_that_is_no_run_says_so(tmp_path):
    assert_one_line_error(run_cli("report", str(tmp_path), timeout=60), "holds no metrics.jsonl")
    assert_one_line_error(run_cli("report", str(tmp_path / "nope"), timeout=60), "not found")
