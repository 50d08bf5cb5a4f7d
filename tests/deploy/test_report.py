"""`isthmus report` on a real run directory."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_line_error, run_cli

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_report_draws_plausible_plots_of_a_real_run(two_runs):
    # The module's raw run (2 sites x 2 ranks, 6 steps of tiny): a run of its own cost
    # ~15 s of rank start-up on 2 cores and showed the report nothing more.
    run_dir = two_runs[0]
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
    # Issue 61: each site's lane watched its link to the other, live, every step.
    for site, peer in (("site0", "site1"), ("site1", "site0")):
        lines = (run_dir / "sites" / site / "metrics.jsonl").read_text().splitlines()
        for k, line in enumerate(lines):
            step = json.loads(line)
            link = step["links"][peer]
            assert link["transport"] == "bulk" and 0 < link["bytes"] <= step["bytes_sent"] * 2
            assert link["line_share"] > 0 and step["hidden_sync_s"] >= 0
            if k == len(lines) - 1 and link["rtt_ms"] is None:
                continue  # the peer that finished first closed the last step's connections
            assert link["rtt_ms"] > 0 and link["retrans"] >= 0
        assert f"link {site}->{peer}: " in text and "Gbit/s" in text
    assert_plot(run_dir / "links.png", (700, 600))
    assert "straggler: " in text and summary["straggler"]["slowest"] in summary["links"]
    # Issue 62: goodput and the time lost by cause; issue 61: egress priced, budget passed.
    assert 0 < summary["goodput_share"] <= 1 and summary["lost_s"]["start-up"] > 0
    assert "goodput: " in text and "committed tokens/s" in text
    assert_plot(run_dir / "goodput.png", (700, 400))
    egress = summary["egress"]
    assert set(egress["links"]) == {"site0->site1", "site1->site0"}
    sent = sum(link["bytes"] for link in egress["links"].values())
    assert sent == pytest.approx(summary["cross_site_bytes"])
    assert egress["usd"] == pytest.approx(sent / 1e9 * 0.02) and egress["budget_usd"] == 1e-7
    assert "egress: $" in text and "budget" in text
    for site in ("site0", "site1"):
        log = (run_dir / "logs" / f"{site}-rank0.log").read_text()
        assert log.count("passed wan.egress_budget_usd") == 1, log[-2000:]


def test_report_of_a_folder_that_is_no_run_says_so(tmp_path):
    assert_one_line_error(run_cli("report", str(tmp_path), timeout=60), "holds no metrics.jsonl")
    assert_one_line_error(run_cli("report", str(tmp_path / "nope"), timeout=60), "not found")


# --- several runs: `isthmus report RUN_A RUN_B ...` ---------------------------------

TINY = ("--set", "model.preset=tiny", "--quiet")
# Issue 61's egress: every link at 2 cents a GB, a budget the first step passes.
PRICED = ("--set", "wan.egress_usd_per_gb=0.02", "--set", "wan.egress_budget_usd=1e-7")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two finished tiny runs that differ in the codec (and the steps), read by every
    test of a real run's report."""
    root = tmp_path_factory.mktemp("runs")
    runs = []
    for codec, steps in (("raw", "6"), ("int8", "4")):
        run_dir = root / codec
        trained = run_cli(
            "local", "--steps", steps, "--set", f"sync.codec={codec}", *TINY, *PRICED,
            "--run-dir", str(run_dir),
        )  # fmt: skip
        assert trained.returncode == 0, trained.stderr[-2000:]
        runs.append(run_dir)
    return runs[0], runs[1]


def table_rows(text: str) -> list[list[str]]:
    """compare.txt's rows (header and rule left out), split at runs of 2+ spaces."""
    lines = text.splitlines()
    assert lines[1].startswith("----"), text
    return [re.split(r" {2,}", line.strip()) for line in lines[2 : lines.index("")]]


def measured_held_out(run_dir: Path) -> bool:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return any("val_loss" in json.loads(line) for line in lines)


def assert_plot(path: Path, size: tuple[int, int]) -> None:
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert (image.shape[1], image.shape[0]) == size, path.name
    rgb = image[..., :3]
    # Not blank: a plot has white background and enough drawn (coloured) pixels.
    assert 0.02 < np.mean(np.any(rgb < 0.9, axis=-1)) < 0.6, path.name
    assert np.mean(rgb.max(axis=-1) - rgb.min(axis=-1) > 0.2) > 0.005, path.name


@pytest.mark.slow
def test_report_compares_two_real_runs_against_the_first(two_runs, tmp_path):
    raw, int8 = two_runs
    result = run_cli("report", str(raw), str(int8), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "isthmus-compare"  # the documented default
    for name in ("compare_loss_tokens.png", "compare_loss_time.png", "compare_bytes.png"):
        assert_plot(out / name, (800, 450))
    text = (out / "compare.txt").read_text()
    assert text in result.stdout
    header = re.split(r" {2,}", text.splitlines()[0])
    rows = table_rows(text)
    assert len(rows) == 2 and all(len(row) == len(header) for row in rows), text
    column = {name: [row[i] for row in rows] for i, name in enumerate(header)}
    # Labels say what differs: the codec, and the steps.
    assert column["run"] == ["raw 6 steps", "int8 4 steps"]
    assert column["sync"] == ["step", "step"] and column["codec"] == ["raw", "int8"]
    assert column["sites x ranks"] == ["2 x 2", "2 x 2"] and column["steps"] == ["6", "4"]
    for run_dir, row in zip(two_runs, rows, strict=True):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert row[header.index("tokens")] == f"{summary['tokens']:,}"
        assert row[header.index("bytes across/token")] == f"{summary['bytes_per_token']:,.1f}"
        assert row[header.index("tokens/s")] == f"{summary['tokens_per_s']:,.0f}"
        losses = [
            json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        last = losses[-5:]  # the int8 run has only 4 steps: their mean
        assert float(row[header.index("train loss (last 5)")]) == pytest.approx(
            sum(last) / len(last), abs=1e-4
        )
    # int8 sends a quarter of raw's fp32 gradients' bytes (plus scales).
    per_token = [float(x.replace(",", "")) for x in column["bytes across/token"]]
    assert 0.2 < per_token[1] / per_token[0] < 0.3
    # Every run measures the held-out loss after its last step: the table shows it, and
    # int8's relative to raw's.
    held_out, relative = column["held-out loss"], column["vs first"]
    assert measured_held_out(raw) and measured_held_out(int8)
    values = [json.loads((run / "summary.json").read_text())["val_loss"] for run in (raw, int8)]
    assert [float(v) for v in held_out] == pytest.approx(values, abs=1e-4)
    assert relative[0] == "+0.00%"
    change = 100 * (float(held_out[1]) / float(held_out[0]) - 1)
    assert float(relative[1].rstrip("%")) == pytest.approx(change, abs=0.01)


@pytest.mark.slow
def test_report_labels_runs_as_told_and_reads_site_runs_and_other_versions(two_runs, tmp_path):
    raw, int8 = two_runs
    # An `isthmus site` run's folder (sites/SITE/ with its own summary.json, config-SITE.toml),
    # made from the raw run; its config holds a key this version does not know.
    site_run = tmp_path / "site-run"
    shutil.copytree(raw, site_run)
    (site_run / "metrics.jsonl").unlink()
    summary = (site_run / "summary.json").read_text()
    (site_run / "summary.json").unlink()
    for site in ("site0", "site1"):
        (site_run / "sites" / site / "summary.json").write_text(summary)
    config = (site_run / "config.toml").read_text().replace("[run]", "[run]\nretired_key = 1")
    (site_run / "config-site0.toml").write_text(config)
    (site_run / "config.toml").unlink()
    out = tmp_path / "out"
    result = run_cli(
        "report", str(raw), str(site_run), str(int8), "--labels", "base, as sites,int8",
        "--out", str(out), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = (out / "compare.txt").read_text()
    rows = table_rows(text)
    assert [row[0] for row in rows] == ["base", "as sites", "int8"]
    assert "vs first: held-out loss relative to the first run's (base)" in text
    assert rows[1][1:] == rows[0][1:], text  # the same run, read from the other layout
    # With only one site's folder, tokens and bytes are that site's, and the table says so.
    shutil.rmtree(site_run / "sites" / "site1")
    result = run_cli("report", str(raw), str(site_run), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    rows = table_rows((out / "compare.txt").read_text())
    tokens = [int(row[5].replace(",", "")) for row in rows]
    assert tokens[1] * 2 == tokens[0], rows
    assert "only site0's records" in result.stdout


@pytest.mark.slow
def test_report_of_runs_refuses_bad_input_and_writes_nothing(two_runs, tmp_path):
    raw, int8 = two_runs
    unfinished = tmp_path / "unfinished"
    shutil.copytree(int8, unfinished)
    (unfinished / "summary.json").unlink()
    out = tmp_path / "out"
    cases = [
        ((str(raw), str(unfinished)), "the run did not finish"),
        ((str(raw), str(tmp_path / "nope")), "not found"),
        ((str(raw), str(int8), str(raw.parent / ".." / raw.parent.name / "raw")), "given twice"),
        ((str(raw), str(int8), "--labels", "a"), "--labels names 1 run(s) but 2"),
        ((str(raw), str(int8), "--labels", "a,a"), "distinct"),
        ((str(raw), "--labels", "a"), "two or more"),
    ]
    for args, needle in cases:
        assert_one_line_error(run_cli("report", *args, "--out", str(out), timeout=60), needle)
        assert not out.exists(), args


def test_report_of_runs_names_what_is_wrong_before_reading_them(tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text('{"step": 0}\n')
    out = tmp_path / "out"
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for args, needle in (
        ((a, b, "--labels", "x,y,z"), "--labels names 3 run(s) but 2"),
        ((a, b, a), "given twice"),
        ((str(unfinished), a), "the run did not finish"),
    ):
        assert_one_line_error(run_cli("report", *args, "--out", str(out), timeout=60), needle)
        assert not out.exists(), args
