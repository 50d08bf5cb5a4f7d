"""Sync modes end to end: `isthmus local --set sync.mode=diloco` over real lanes and
emulated links, its checkpoints and resume, and its settings refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli

TINY = ["--set", "model.preset=tiny", "--set", "train.seq_len=64", "--ranks-per-site", "2"]
DILOCO = ["--set", "sync.mode=diloco", "--set", "sync.inner_steps=3"]


def records(run_dir: Path, site: str) -> list[dict]:
    lines = (run_dir / "sites" / site / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# H = 3 over 8 steps with a checkpoint after 4: rounds start after steps 2, 5 and 7.
# Without a delay each lands at once. With delay 2 the first would land after step 4,
# but the checkpoint after step 3 lands it first; the second lands at the last step,
# just before the last round, which lands at once.
LANDINGS = {0: ([2, 5, 7], [0, 0, 1, 1, 1, 2, 2, 3]), 2: ([3, 7], [0, 0, 0, 1, 1, 1, 1, 3])}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("delay", sorted(LANDINGS))
def test_diloco_crosses_only_on_outer_steps_and_resumes_bit_for_bit(tmp_path, delay):
    """2 sites x 2 ranks (FSDP shards): replicas (with a delay: anchors) equal after
    every landed round, different in between; a resume lands on the same digest."""
    first = tmp_path / "first"
    common = [*TINY, *DILOCO, "--steps", "8", "--set", "run.digest_every=1"]
    common += ["--set", f"sync.outer_delay={delay}"]
    result = run_cli(
        "local", *common, "--run-dir", str(first), "--set", "checkpoint.every=4", timeout=400
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas            identical" in result.stdout
    assert "DiLoCo: 3 outer steps" in result.stdout
    site0, site1 = records(first, "site0"), records(first, "site1")
    landed, outer_steps = LANDINGS[delay]
    for recs in (site0, site1):
        assert [r["step"] for r in recs if r["bytes_sent"] > 0] == landed
        assert [r["step"] for r in recs if r.get("digest")] == landed
        assert [r["outer_steps"] for r in recs] == outer_steps
        assert all(r["live_sites"] == 2 for r in recs)
    for a, b in zip(site0, site1, strict=True):
        assert a.get("digest") == b.get("digest")  # equal after every outer step
    # The sites train on their own data between outer steps: their losses differ.
    assert all(a["loss"] != b["loss"] for a, b in zip(site0, site1, strict=True))
    summary = json.loads((first / "summary.json").read_text())
    final = summary["digests"]
    assert len(set(final.values())) == 1
    assert summary["sync_mode"] == "diloco" and summary["outer_steps"] == 3
    report = run_cli("report", str(first), timeout=120)
    assert report.returncode == 0, report.stderr
    assert "DiLoCo outer steps: 3" in report.stdout and (first / "loss_vs_cost.png").exists()

    if not delay:
        return  # the resume below covers both: its state is mid-round either way
    # Resume from the checkpoint after 4 steps: mid-round (the next round starts after
    # step 5), so the anchor and outer momentum must come back with the inner state.
    second = tmp_path / "second"
    result = run_cli(
        "local",
        *common,
        "--run-dir",
        str(second),
        "--set",
        f"checkpoint.dir={first / 'checkpoints'}",
        "--set",
        "checkpoint.resume_step=4",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = json.loads((second / "summary.json").read_text())["digests"]
    assert resumed == final
    assert [r["step"] for r in records(second, "site0")] == [4, 5, 6, 7]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_sites_in_overlapped_diloco_end_identical(tmp_path):
    """3 sites x 1 rank, H = 2, delay 1: rounds land one step late, anchors agree at
    every landing and the parameters at the end."""
    run_dir = tmp_path / "run"
    result = run_cli(
        "local",
        "--sites", "3", "--ranks-per-site", "1", "--steps", "7",
        "--set", "model.preset=tiny", "--set", "train.seq_len=64",
        "--set", "sync.mode=diloco", "--set", "sync.inner_steps=2",
        "--set", "sync.outer_delay=1", "--set", "run.digest_every=1",
        "--run-dir", str(run_dir),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    sites = [records(run_dir, f"site{i}") for i in range(3)]
    # Rounds start after steps 1, 3, 5 and 6 (the last); each lands a step later,
    # the one after step 5 at the last step, where the last lands at once.
    for recs in sites:
        assert [r["step"] for r in recs if r.get("digest")] == [2, 4, 6]
        assert all(r["live_sites"] == 3 for r in recs)
    for step in (2, 4, 6):
        assert len({recs[step]["digest"] for recs in sites}) == 1
    final = json.loads((run_dir / "summary.json").read_text())["digests"]
    assert len(final) == 3 and len(set(final.values())) == 1


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("sync.mode=async", "sync.mode must be one of step, diloco, got 'async'"),
        ("sync.inner_steps=0", "sync.inner_steps must be >= 1, got 0"),
        ("sync.outer_lr=0", "sync.outer_lr must be > 0, got 0"),
        ("sync.outer_momentum=1", "sync.outer_momentum must be in [0, 1), got 1"),
        ("sync.outer_delay=50", "sync.outer_delay must be in 0..inner_steps-1 = 0..49, got 50"),
    ],
)
def test_bad_sync_mode_settings_are_one_line_errors(tmp_path, setting, needle):
    result = run_cli("local", "--set", setting, "--run-dir", str(tmp_path / "run"), timeout=60)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_the_sync_mode_is_part_of_the_job_fingerprint():
    from isthmus.deploy.config import load_config

    step = load_config(None, []).fingerprint()
    diloco = load_config(None, ["sync.mode=diloco", "sync.inner_steps=20"]).fingerprint()
    assert step["sync.mode"] == "step" and diloco["sync.mode"] == "diloco"
    assert diloco["sync.inner_steps"] == "20"
    assert {"sync.outer_lr", "sync.outer_momentum"} <= set(diloco)
