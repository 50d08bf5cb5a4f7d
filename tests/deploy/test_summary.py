"""How the run's summary turns per-site step lines into exposed sync, overlap and
steady-state throughput (deploy/reports/summary.py), and how the progress line shows them."""

from __future__ import annotations

import io
import json

import pytest

from isthmus.deploy.config.job import load_config
from isthmus.deploy.launch.progress import Progress
from isthmus.deploy.reports.summary import merge_steps, overlap, print_summary, steady_state


def line(site: str, step: int, *, elapsed: float, exposed: float, busy: float, **extra) -> dict:
    """One site's metrics.jsonl line as deploy/rank/program.py writes it."""
    return {
        "site": site,
        "step": step,
        "loss": 5.0 - step * 0.1,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "compute_s": 1.0,
        "sync_s": exposed,
        "exposed_sync_s": exposed,
        "sync_busy_s": busy,
        "tokens": 1000,
        "mfu": 0.4,
        "bytes_sent": 10,
        "raw_bytes": 40,
        "corrupt_chunks": 0,
        "elapsed_s": elapsed,
        "digest_s": 0.0,
        **extra,
    }


def test_the_slowest_site_sets_a_steps_exposed_and_busy_time():
    merged = merge_steps(
        {
            "site0": [line("site0", 0, elapsed=1.0, exposed=0.1, busy=0.8)],
            "site1": [line("site1", 0, elapsed=1.2, exposed=0.3, busy=0.7)],
        }
    )
    assert merged[0]["exposed_sync_s"] == 0.3 and merged[0]["sync_busy_s"] == 0.8
    assert merged[0]["tokens"] == 2000 and merged[0]["elapsed_s"] == 1.2


def test_lines_of_older_runs_without_exposed_sync_fall_back_to_the_wait():
    old = line("site0", 0, elapsed=1.0, exposed=0.25, busy=0.5)
    del old["exposed_sync_s"], old["digest_s"]
    assert merge_steps({"site0": [old]})[0]["exposed_sync_s"] == 0.25


def test_overlap_is_the_share_of_the_rounds_the_step_did_not_wait_for():
    assert overlap(0.2, 0.8) == pytest.approx(0.75)
    assert overlap(0.0, 0.5) == 1.0
    # A step can wait longer than its rounds ran (the vote after them): nothing hidden.
    assert overlap(0.6, 0.5) == 0.0
    assert overlap(0.0, 0.0) is None  # one site: nothing to hide


def test_steady_state_leaves_out_warm_up_steps_and_digest_time():
    # Step 0 takes 30 s (compilation), then 1 s per step; step 3 spent 0.5 s on a digest.
    elapsed = [30.0, 31.0, 32.0, 33.5, 34.5]
    steps = merge_steps(
        {
            "site0": [
                line(
                    "site0",
                    i,
                    elapsed=t,
                    exposed=5.0 if i == 0 else 0.1,
                    busy=0.4,
                    digest_s=0.5 if i == 3 else 0.0,
                )
                for i, t in enumerate(elapsed)
            ]
        }
    )
    steady = steady_state(steps, skip=2)
    assert steady["steady_steps"] == 3
    # Steps 2..4: from the end of step 1 (31.0) to the end (34.5), less the digest.
    assert steady["steady_step_s"] == pytest.approx(3.0 / 3)
    assert steady["steady_tokens_per_s"] == pytest.approx(3000 / 3.0)
    assert steady["exposed_sync_s_per_step"] == pytest.approx(0.1)
    assert steady["sync_busy_s_per_step"] == pytest.approx(0.4)
    # Asked to skip all of a short run, it leaves out only the first step.
    assert steady_state(steps[:2], skip=5)["steady_steps"] == 1
    assert steady_state(steps[:1], skip=2)["steady_steps"] == 1
    assert steady_state([], skip=2) == {}


def test_progress_ends_on_the_last_step_written_after_its_last_update(tmp_path):
    """Seen in CI: the ranks wrote their last steps between the launcher's last update
    and its check that they had exited, and the run's last line read "step 18/20"."""
    config = load_config(overrides=["job.steps=3"])
    paths = [tmp_path / "sites" / site / "metrics.jsonl" for site in config.site_names]
    for path in paths:
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(line(path.parent.name, 0, elapsed=1, exposed=0, busy=0)) + "\n")
    out = io.StringIO()
    progress = Progress(config.topology, config.job.steps, tmp_path, out)
    progress.update()
    for path in paths:
        with path.open("a") as f:
            for i in (1, 2):
                f.write(json.dumps(line(path.parent.name, i, elapsed=i + 1, exposed=0, busy=0)))
                f.write("\n")
    progress.close()
    assert out.getvalue().rstrip().splitlines()[-1].split("]")[1].startswith(" step 3/3")


def test_progress_line_and_summary_show_the_sync_and_what_of_it_was_exposed(tmp_path):
    config = load_config(overrides=["job.steps=2"])
    for site in config.site_names:
        path = tmp_path / "sites" / site / "metrics.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text(
            "".join(
                json.dumps(line(site, i, elapsed=i + 1.0, exposed=0.02, busy=0.074)) + "\n"
                for i in range(2)
            )
        )
    out = io.StringIO()
    progress = Progress(config.topology, config.job.steps, tmp_path, out)
    progress.update()
    assert "step 2/2" in out.getvalue()
    assert "cross-site 0.074 s/step  exposed 0.020 s/step" in out.getvalue()

    steps = merge_steps({s: [line(s, 0, elapsed=1.0, exposed=0.02, busy=0.08)] for s in "ab"})
    summary = {
        "sites": 2,
        "steps": 1,
        "loss_first": 5.0,
        "loss_last": 5.0,
        "tokens_per_s": 100.0,
        "mfu": 0.4,
        "compute_s": 1.0,
        "sync_busy_s": steps[0]["sync_busy_s"],
        "exposed_sync_s": steps[0]["exposed_sync_s"],
        "sync_busy_s_per_step": 0.08,
        "exposed_sync_s_per_step": 0.02,
        "overlap": overlap(0.02, 0.08),
        "cross_site_bytes": 10,
        "compression_ratio": 4.0,
        "codec": "int8",
        "digests": {"site0": "ab" * 32, "site1": "ab" * 32},
    }
    text = io.StringIO()
    print_summary(summary, text, None)
    assert "0.080 s/step in rounds" in text.getvalue()
    assert "0.020 s/step waited, 75% overlapped" in text.getvalue()


def test_the_held_out_set_does_not_change_with_the_layout():
    """One rank with batch 16 and two ranks with batch 8 (or two sites of one) must be
    measured on the same held-out text, or their held-out losses do not compare."""
    import torch
    from helpers import job_corpus

    from isthmus.deploy.config.job import load_config
    from isthmus.deploy.rank.evaluation import HeldOutLoss

    windows = []
    for overrides in (["train.batch_size=8"], ["train.batch_size=16", "topology.sites=1"]):
        config = load_config(None, ["model.preset=tiny", "data.max_bytes=1000000", *overrides])
        corpus, split = job_corpus(config)
        held_out = HeldOutLoss(corpus, split, config.run, config.job, seq_len=config.train.seq_len)
        windows.append([held_out.batches.batch(i)[0] for i in range(held_out.batches_per_eval)])
    assert len(windows[0]) == len(windows[1]) == 16
    assert all(torch.equal(a, b) for a, b in zip(*windows, strict=True))
