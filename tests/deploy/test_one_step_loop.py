"""The built-in trainer and a user's script (isthmus.deploy.api) end their steps in one
step loop (``StepLoop``, deploy/rank/loop.py), so they cannot drift. Cut off by the
chaos suite's partition, each job's site1 rejoins alike: paced by the rank's fault
injection, it pulls the live state and goes on at the step site0's commit admitted it
at. Both jobs' steps record the same metrics keys, except the trainer's own (its batch
plan's and its held-out loss)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ROOT

from isthmus.deploy.chaos.suite import SCENARIOS, run_scenario

pytestmark = pytest.mark.slow

PARTITION = next(s for s in SCENARIOS if s.name == "partition")
TWIN = ROOT / "examples" / "preset.py"
"""The built-in model trained through the API; it prints the step a rejoin goes on at."""
TRAINER_ONLY = {"micro_batches", "global_batch", "noise_scale", "val_loss", "eval_s"}


def metrics(run: Path, site: str) -> list[dict]:
    text = (run / "sites" / site / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def rejoined_at(run: Path) -> int:
    """The step site1 went on at after the partition, checked to be the first that
    site0 trained with both sites live again (its commit before offered the state)."""
    steps = [line["step"] for line in metrics(run, "site1")]
    gap = next(i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1)
    assert steps[gap:] == list(range(steps[gap], PARTITION.steps)), steps  # on to the end
    alone = [line["step"] for line in metrics(run, "site0") if line["live_sites"] == 1]
    assert alone and steps[gap] == alone[-1] + 1, (steps, alone)
    return steps[gap]


@pytest.mark.timeout(400)
def test_a_cut_off_site_rejoins_alike_under_the_trainer_and_a_script(tmp_path):
    keys = {}
    for user, script in (("trainer", None), ("script", TWIN)):
        result = run_scenario(PARTITION, tmp_path / user, script=script)
        assert result.ok, f"{user}: {result.why}"
        assert result.rejoined == ["site1"], user
        run = tmp_path / user / "run"
        step = rejoined_at(run)
        keys[user] = {
            key for site in ("site0", "site1") for line in metrics(run, site) for key in line
        }
    # The script's Outcome told it the step that ctx.steps() then went on at.
    log = (tmp_path / "script" / "run" / "logs" / "site1-rank0.log").read_text()
    assert f"rejoined at step {step}\n" in log
    assert keys["script"] == keys["trainer"] - TRAINER_ONLY
