"""The built-in trainer and a user's script (isthmus.deploy.api) end their steps in one
step loop (``StepLoop``, deploy/rank/loop.py), so they cannot drift. Cut off by the
chaos suite's partition, each job's site1 rejoins alike: paced by the rank's fault
injection, it pulls the live state and goes on at the step site0's commit admitted it
at, and every step records the loop's metrics keys. (The trainer's half of the same
scenario is test_chaos.py's partition; running it here again cost a minute of CI.)"""

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
LOOP_KEYS = {
    "site", "step", "loss", "grad_norm", "lr", "compute_s", "sync_s", "tokens", "mfu",
    "bytes_sent", "raw_bytes", "corrupt_chunks", "nonfinite_chunks", "elapsed_s",
    "exposed_sync_s", "sync_busy_s", "digest_s", "live_sites", "generation", "retries",
    "outer_steps",
}  # fmt: skip
"""What the step loop writes in every step's line, for the trainer and a script alike."""


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


@pytest.mark.timeout(300)
def test_a_cut_off_site_rejoins_under_a_script_as_under_the_trainer(tmp_path):
    result = run_scenario(PARTITION, tmp_path, script=TWIN)
    assert result.ok, result.why
    assert result.rejoined == ["site1"]
    run = tmp_path / "run"
    step = rejoined_at(run)
    # The script's Outcome told it the step that ctx.steps() then went on at.
    log = (run / "logs" / "site1-rank0.log").read_text()
    assert f"rejoined at step {step}\n" in log
    for site in ("site0", "site1"):
        for line in metrics(run, site):
            assert line.keys() >= LOOP_KEYS, (site, line)
