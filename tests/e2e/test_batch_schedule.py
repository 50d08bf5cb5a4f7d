"""The global batch over time (issue 15, part 3): a ramp and the noise-scale controller,
with the real `isthmus local` (deploy/batch/plan.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import run_cli

from isthmus.deploy.chaos.suite import SCENARIOS, run_scenario

pytestmark = pytest.mark.slow

# run.eval_batches=1: no test here reads the held-out loss, measured on one batch instead
# of 16 (16 cost each site seconds of forward passes on 2 cores, every 50 steps).
TINY = ("--set", "model.preset=tiny", "--set", "train.batch_size=2", "--set", "train.seq_len=64",
        "--set", "run.eval_batches=1")  # fmt: skip


def _run(run_dir: Path, sites: int, *extra: str, steps: int) -> dict:
    result = run_cli(
        "local", "--sites", str(sites), "--ranks-per-site", "1", "--steps", str(steps),
        "--quiet", "--run-dir", str(run_dir), *TINY, *extra, timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_a_ramped_batch_over_two_sites_trains_like_one_site_on_the_same_ramp(tmp_path):
    """From 2 to 8 micro-batches over 8 steps: the two sites split each size between
    them (in train.accumulate's shares), the learning rate follows it, and every
    step's loss equals one site taking the whole batch."""
    ramp = ("--set", "train.batch_schedule=ramp", "--set", "train.batch_ramp_steps=8",
            "--set", "train.batch_start=2")  # fmt: skip
    two = _run(tmp_path / "two", 2, "--set", "train.accumulate=4", *ramp, steps=12)
    _run(tmp_path / "one", 1, "--set", "train.accumulate=8", *ramp, steps=12)
    split, whole = _records(tmp_path / "two"), _records(tmp_path / "one")
    assert len(set(two["digests"].values())) == 1
    # Megatron's stages in steps: 2 + floor(6 * step / 8) micro-batches of 2 sequences.
    want = [2 * (2 + 6 * s // 8) if s < 8 else 16 for s in range(12)]
    assert [r["global_batch"] for r in split] == [r["global_batch"] for r in whole] == want
    for r in split:  # equal shares: the sites differ by at most one micro-batch
        counts = r["micro_batches_by_site"]
        assert sum(counts.values()) * 2 == r["global_batch"]
        assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert split[0]["lr"] < split[-1]["lr"] or split[0]["lr"] == whole[0]["lr"]
    for a, b in zip(split, whole, strict=True):
        assert a["lr"] == b["lr"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])


@pytest.mark.timeout(600)
def test_the_noise_scale_grows_the_batch_as_the_loss_falls_and_the_report_plots_it(tmp_path):
    """train.batch_schedule=noise on two sites: the noise scale is estimated from each
    site's own mean gradient against the global one, rises as the loss falls, and the
    batch grows after it (never shrinks, never past train.accumulate's), the same at
    both sites; `isthmus report` draws batch.png."""
    run = tmp_path / "noise"
    summary = _run(
        run, 2, "--set", "train.accumulate=8", "--set", "train.batch_schedule=noise",
        "--set", "train.batch_start=2", "--set", "train.balance_every=5", steps=100,
    )  # fmt: skip
    assert len(set(summary["digests"].values())) == 1
    records = _records(run)
    batches = [r["global_batch"] for r in records]
    assert batches[0] == 4 and batches[-1] > batches[0]
    assert all(b <= a for a, b in zip(batches[1:], batches, strict=False))  # never shrinks
    assert max(batches) <= 2 * 16
    scales = [r["noise_scale"] for r in records if "noise_scale" in r]
    assert scales and all(s > 0 for s in scales)
    assert sum(scales[-10:]) / 10 > sum(scales[:10]) / 10  # larger as the loss falls
    # Both sites logged the same batch at every step (their decisions are one sum's).
    per_site = {
        site: [json.loads(x)["global_batch"] for x in (run / "sites" / site / "metrics.jsonl")
               .read_text().splitlines()]
        for site in ("site0", "site1")
    }  # fmt: skip
    assert per_site["site0"] == per_site["site1"] == batches
    report = run_cli("report", str(run), timeout=120)
    assert report.returncode == 0, report.stderr
    assert (run / "batch.png").stat().st_size > 10_000


@pytest.mark.timeout(400)
def test_a_restarted_site_rejoins_with_the_batch_the_job_has_grown_to(tmp_path):
    """kill-restart with the noise schedule: site1 pulls the split, the timings and
    the noise scale's averages with the state, and from then on both sites log the
    same global batch at every step."""
    # 120 steps, not the scenario's 60: the noise scale needs both sites, so the batch
    # grows only after the rejoin, and a restart slowed by a busy machine rejoined at
    # step 45 of 60, too late to see it grow (about 20 steps after a rejoin).
    kill_restart = next(s for s in SCENARIOS if s.name == "kill-restart")
    scenario = dataclasses.replace(kill_restart, steps=120)
    # Sequences of their own as micro-batches, so the batch grows within the run.
    overrides = ("train.batch_size=1", "train.accumulate=8", "train.batch_schedule=noise",
                 "train.batch_start=2", "train.balance_every=4")  # fmt: skip
    result = run_scenario(scenario, tmp_path, overrides=overrides)
    assert result.ok, result.why
    assert result.rejoined == ["site1"]
    sites = tmp_path / "run" / "sites"
    logged = {
        site: {
            r["step"]: r["global_batch"]
            for r in map(json.loads, (sites / site / "metrics.jsonl").read_text().splitlines())
        }
        for site in ("site0", "site1")
    }
    both = sorted(set(logged["site0"]) & set(logged["site1"]))
    assert both and [logged["site0"][s] for s in both] == [logged["site1"][s] for s in both]
    assert logged["site1"][both[-1]] > logged["site1"][both[0]]  # it grew after the rejoin
