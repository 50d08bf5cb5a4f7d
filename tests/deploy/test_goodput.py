"""Goodput and the time lost by cause (deploy/reports/goodput.py), on merged steps as
summary.py writes them, and the merge of a run where a site left and came back."""

from __future__ import annotations

import pytest

from isthmus.deploy.reports.goodput import goodput, goodput_rows, step_causes
from isthmus.deploy.reports.summary import merge_steps


def steps_of(walls: list[float], **marks: dict[int, dict]) -> list[dict]:
    """Merged steps of these wall times (100 tokens each); ``marks``: step -> fields."""
    steps, elapsed = [], 0.0
    for i, wall in enumerate(walls):
        elapsed += wall
        steps.append({"step": i, "tokens": 100, "elapsed_s": elapsed, "live_sites": 2})
        steps[-1].update(marks.get("at", {}).get(i, {}))
    return steps


def test_a_fault_free_run_loses_only_its_start_up_and_checks() -> None:
    # Step 5 digests (0.3 s of its 0.8), step 9 evaluates (0.1 s of its 0.6).
    walls = [3.0, 0.5, 0.5, 0.5, 0.5, 0.8, 0.5, 0.5, 0.5, 0.6]
    steps = steps_of(walls, at={5: {"digest_s": 0.3}, 9: {"eval_s": 0.1}})
    summary = goodput(steps)
    assert summary["healthy_step_s"] == pytest.approx(0.5)
    assert summary["lost_s"]["start-up"] == pytest.approx(2.5)
    assert summary["lost_s"]["checks"] == pytest.approx(0.4)
    assert summary["lost_s"]["retries"] == summary["lost_s"]["stalls"] == 0.0
    assert summary["goodput_tokens_per_s"] == pytest.approx(1000 / 7.9)
    assert summary["goodput_share"] == pytest.approx(1 - 2.9 / 7.9)
    # A site's own clock, where the merged record has it, is the step's wall.
    steps[3]["wall_s"] = 1.5
    assert goodput(steps)["lost_s"]["stalls"] == pytest.approx(1.0)


def test_each_lost_second_goes_to_its_cause() -> None:
    marks = {
        3: {"retries": 1, "live_sites": 1},  # a site died: detected, rerun without it
        4: {"live_sites": 1},
        5: {"live_sites": 1},
        6: {"live_sites": 2, "state_pull_s": 1.5, "state_pull_bytes": 4_000_000},  # back
        8: {},  # a stall: no fault named in its line
    }
    steps = steps_of([2.0, 0.5, 0.5, 1.7, 0.5, 0.5, 2.5, 0.5, 1.5, 0.5], at=marks)
    _, causes, healthy = step_causes(steps)
    assert healthy == pytest.approx(0.5)
    assert causes == [
        "start-up",
        None,
        None,
        "retries",
        None,
        None,
        "rejoins",
        None,
        "stalls",
        None,
    ]
    lost = goodput(steps)["lost_s"]
    assert lost == pytest.approx(
        {"start-up": 1.5, "retries": 1.2, "rejoins": 2.0, "stalls": 1.0, "checks": 0.0}
    )
    assert goodput(steps)["state_pulls"] == {"seconds": 1.5, "bytes": 4_000_000}
    rows = dict(goodput_rows(goodput(steps)))
    assert rows["time lost"] == "start-up 1.5 s, retries 1.2 s, rejoins 2.0 s, stalls 1.0 s"
    assert rows["state pulled"] == "4.0 MB in 1.50 s"


def test_a_site_absent_from_some_steps_leaves_the_others_steps_in_the_run() -> None:
    def line(site: str, step: int, **more) -> dict:
        return {
            "site": site,
            "step": step,
            "loss": 2.0,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tokens": 100,
            "compute_s": 0.1,
            "sync_s": 0.1,
            "bytes_sent": 10,
            "raw_bytes": 10,
            "elapsed_s": 1.0 + step,
            **more,
        }

    site0 = [line("site0", s, live_sites=1 if 3 <= s < 6 else 2) for s in range(8)]
    site1 = [line("site1", s) for s in (0, 1, 2)]  # killed in step 3,
    site1 += [line("site1", s, state_pull_s=0.5, state_pull_bytes=7) for s in (6,)]  # back
    site1 += [line("site1", 7)]
    merged = merge_steps({"site0": site0, "site1": site1})
    assert [r["step"] for r in merged] == list(range(8))
    assert [r["tokens"] for r in merged] == [200, 200, 200, 100, 100, 100, 200, 200]
    assert merged[6]["state_pull_bytes"] == 7 and merged[6]["live_sites"] == 2
    # Each step's wall is a site's own step, never the time site1 spent out of the job.
    assert [r["wall_s"] for r in merged] == [1.0] * 8
    assert step_causes(merged)[1][6] == "rejoins"
