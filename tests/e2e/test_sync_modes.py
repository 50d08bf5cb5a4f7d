"""Sync modes end to end: `isthmus local --set sync.mode=diloco` over real lanes and
emulated links, its checkpoints and resume, and its settings refused in one line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_one_line_error, load_benchmark, run_benchmark, run_cli

TINY = ["--set", "model.preset=tiny", "--set", "train.seq_len=64", "--ranks-per-site", "2"]


def records(run_dir: Path, site: str) -> list[dict]:
    lines = (run_dir / "sites" / site / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# 8 steps with a checkpoint after 4. DiLoCo, H = 3: rounds start after steps 2, 5 and
# 7. Without a delay each lands at once. With delay 2 the first would land after step 4,
# but the checkpoint after step 3 lands it first; the second lands at the last step,
# just before the last round, which lands at once. Streaming, H = 4, 2 fragments, delay
# 1: fragment 0 after step 1 (lands after 2), fragment 1 after step 3 (landed at once
# by the checkpoint), fragment 0 after 5 (lands after 6), both after the last step.
MODES = {
    "diloco-0": (
        ["sync.mode=diloco", "sync.inner_steps=3", "sync.outer_delay=0"],
        [2, 5, 7],
        [0, 0, 1, 1, 1, 2, 2, 3],
    ),
    "diloco-2": (
        ["sync.mode=diloco", "sync.inner_steps=3", "sync.outer_delay=2"],
        [3, 7],
        [0, 0, 0, 1, 1, 1, 1, 3],
    ),
    "streaming-1": (
        ["sync.mode=streaming", "sync.inner_steps=4", "sync.fragments=2", "sync.outer_delay=1"],
        [2, 3, 6, 7],
        [0, 0, 1, 2, 2, 2, 3, 4],
    ),
}
"""Settings, steps where rounds landed, outer steps (rounds applied) after each step."""


def mode_args(mode: str) -> list[str]:
    """The `isthmus local` arguments of a MODES job, but its run folder and checkpoints."""
    common = [*TINY, "--steps", "8", "--set", "run.digest_every=1"]
    common += ["--set", "run.eval_every=2", "--set", "run.eval_batches=2"]
    for setting in MODES[mode][0]:
        common += ["--set", setting]
    return common


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Callable[[str], tuple[Path, subprocess.CompletedProcess]]:
    """A MODES job of 8 steps with a checkpoint after 4, run once for the module: the
    mode's own test reads it, and the outer learning rate's ramp is measured against
    diloco-0's: one job of 2 x 2 ranks fewer."""
    runs: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(mode: str) -> tuple[Path, subprocess.CompletedProcess]:
        if mode not in runs:
            first = tmp_path_factory.mktemp(mode) / "first"
            result = run_cli(
                "local", *mode_args(mode), "--run-dir", str(first),
                "--set", "checkpoint.every=4", timeout=400,
            )  # fmt: skip
            runs[mode] = first, result
        return runs[mode]

    return run


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_outer_modes_cross_only_on_outer_steps_and_resume_bit_for_bit(tmp_path, mode, first_run):
    """2 sites x 2 ranks (FSDP shards): replicas (with a delay or fragments: anchors)
    equal after every landed round, different in between; a resume lands on the same
    digest."""
    settings, landed, outer_steps = MODES[mode]
    common = mode_args(mode)
    first, result = first_run(mode)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas            identical" in result.stdout
    rounds = outer_steps[-1]
    streaming = mode.startswith("streaming")
    said = f"Streaming DiLoCo: {rounds} fragment rounds" if streaming else f"DiLoCo: {rounds} outer"
    assert said in result.stdout
    site0, site1 = records(first, "site0"), records(first, "site1")
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
    # The held-out loss of the model the sites share (the anchors), every 2 steps: the
    # same at both sites although their local parameters (and training losses) differ.
    for recs in (site0, site1):
        assert [r["step"] for r in recs if "val_loss" in r] == [1, 3, 5, 7]
    assert [r.get("val_loss") for r in site0] == [r.get("val_loss") for r in site1]
    assert summary["val_losses"] == {"site0": site0[-1]["val_loss"], "site1": site1[-1]["val_loss"]}
    assert summary["val_unequal_steps"] == [] and summary["val_step"] == 7
    assert summary["val_loss"] < summary["loss_first"]
    assert summary["sync_mode"] == settings[0].split("=")[1] and summary["outer_steps"] == rounds
    report = run_cli("report", str(first), timeout=120)
    assert report.returncode == 0, report.stderr
    assert f"{rounds} " in report.stdout and (first / "loss_vs_cost.png").exists()
    assert ("Streaming DiLoCo" if streaming else "DiLoCo outer steps") in report.stdout

    if mode == "diloco-0":
        return  # the resumes below cover it: their state is mid-round either way
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
@pytest.mark.parametrize(
    "settings",
    [
        ["sync.mode=diloco", "sync.inner_steps=2"],
        ["sync.mode=streaming", "sync.inner_steps=4", "sync.fragments=2"],
    ],
    ids=["diloco", "streaming"],
)
def test_three_sites_in_overlapped_outer_modes_end_identical(tmp_path, settings):
    """3 sites x 1 rank, a round every 2 steps (DiLoCo H = 2; streaming H = 4 in 2
    fragments), delay 1: rounds land one step late, anchors agree at every landing and
    the parameters at the end."""
    run_dir = tmp_path / "run"
    result = run_cli(
        "local",
        "--sites", "3", "--ranks-per-site", "1", "--steps", "7",
        "--set", "model.preset=tiny", "--set", "train.seq_len=64",
        *[arg for one in settings for arg in ("--set", one)],
        "--set", "sync.outer_delay=1", "--set", "run.digest_every=1",
        "--run-dir", str(run_dir),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    sites = [records(run_dir, f"site{i}") for i in range(3)]
    # Rounds start after steps 1, 3, 5 and 6 (the last; streaming: fragments 0, 1, 0,
    # then both); each lands a step later, the one after step 5 at the last step,
    # where the last lands at once.
    for recs in sites:
        assert [r["step"] for r in recs if r.get("digest")] == [2, 4, 6]
        assert all(r["live_sites"] == 3 for r in recs)
    for step in (2, 4, 6):
        assert len({recs[step]["digest"] for recs in sites}) == 1
    final = json.loads((run_dir / "summary.json").read_text())["digests"]
    assert len(final) == 3 and len(set(final.values())) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streaming_with_pipeline_stages_holding_no_part_of_a_fragment(tmp_path):
    """pp = 2 of tiny's 2 blocks, 2 fragments: the last stage holds nothing of
    fragment 0 (block 0), so its rounds of that fragment are empty, yet every rank
    votes and digests at the same steps and the replicas end identical."""
    run_dir = tmp_path / "run"
    result = run_cli(
        "local", *TINY, "--set", "topology.pp=2", "--steps", "6",
        "--set", "sync.mode=streaming", "--set", "sync.inner_steps=4",
        "--set", "sync.fragments=2", "--set", "run.digest_every=1",
        "--run-dir", str(run_dir),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas            identical" in result.stdout
    site0, site1 = records(run_dir, "site0"), records(run_dir, "site1")
    # Fragment 0 after step 1, fragment 1 after step 3, both after step 5 (the last).
    assert [r["step"] for r in site0 if r.get("digest")] == [1, 3, 5]
    assert [r["outer_steps"] for r in site0] == [0, 1, 1, 2, 2, 3]
    for a, b in zip(site0, site1, strict=True):
        assert a.get("digest") == b.get("digest")


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("sync.mode=async", "sync.mode must be one of step, diloco, streaming, got 'async'"),
        ("sync.inner_steps=0", "sync.inner_steps must be >= 1, got 0"),
        ("sync.outer_lr=0", "sync.outer_lr must be > 0, got 0"),
        ("sync.outer_lr_ramp=-1", "sync.outer_lr_ramp must be > 0, got -1"),
        ("sync.outer_momentum=1", "sync.outer_momentum must be in [0, 1), got 1"),
        ("sync.outer_delay=50", "sync.outer_delay must be in 0..49 (below inner_steps = 50)"),
        (
            "sync.mode=streaming sync.fragments=3",
            "sync.fragments must divide sync.inner_steps=50 and be at most the model's 4 "
            "layers, got 3",
        ),
        (
            "sync.mode=streaming sync.fragments=10",
            "sync.fragments must divide sync.inner_steps=50 and be at most the model's 4 "
            "layers, got 10",
        ),
        (
            "sync.mode=streaming sync.outer_delay=25",
            "sync.outer_delay must be in 0..24 (below inner_steps/fragments = 25), got 25",
        ),
        ("sync.mode=streaming sync.fragment_alpha=2", "sync.fragment_alpha must be in [0, 1]"),
        ("data.val_fraction=0.7", "data.val_fraction must be in [0, 0.5], got 0.7"),
        ("run.eval_every=-1", "run.eval_every and run.eval_batches must be >= 0"),
        (
            "topology.pp=3 topology.ranks_per_site=3 train.batch_size=3",
            "parallel.microbatches=3 with pp > 1, which must divide it",
        ),
    ],
)
def test_bad_sync_mode_settings_are_one_line_errors(tmp_path, setting, needle):
    settings = [arg for one in setting.split() for arg in ("--set", one)]
    result = run_cli("local", *settings, "--run-dir", str(tmp_path / "run"), timeout=60)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.timeout(300)
def test_measuring_the_held_out_loss_changes_nothing_of_training(tmp_path):
    """Streaming DiLoCo measures the anchors swapped in for the local parameters: with a
    measurement after every step the job must end on the digest of one without any."""
    common = ["--set", "model.preset=tiny", "--set", "train.seq_len=64", "--steps", "6"]
    common += ["--set", "sync.mode=streaming", "--set", "sync.inner_steps=4"]
    common += ["--set", "sync.outer_delay=1", "--set", "run.eval_batches=1"]
    digests = []
    for every, run in ((1, "every"), (0, "last")):
        result = run_cli(
            "local",
            *common,
            "--set",
            f"run.eval_every={every}",
            "--run-dir",
            str(tmp_path / run),
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        measured = [r["step"] for r in records(tmp_path / run, "site0") if "val_loss" in r]
        assert measured == (list(range(6)) if every else [5])
        digests.append(summary["digests"]["site0"])
    assert digests[0] == digests[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_ramped_outer_learning_rate_reaches_the_outer_steps_of_every_site(tmp_path, first_run):
    """sync.outer_lr_ramp travels from the job's config to every rank's outer optimizer:
    the same job with the ramp ends on other parameters, equal at both sites. The job is
    diloco-0's (ramp 1, the default): tiny warms up for 5 of its 8 steps, so the cosine
    has gone 3/4 of its way at the last round (after step 7), whose outer learning rate
    a ramp of 3 makes 2.5 times as large."""
    plain, result = first_run("diloco-0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas            identical" in result.stdout
    ramped = tmp_path / "ramp3"
    result = run_cli(
        "local", *mode_args("diloco-0"), "--set", "sync.outer_lr_ramp=3",
        "--run-dir", str(ramped), "--set", "checkpoint.every=4", timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas            identical" in result.stdout
    digests = [json.loads((run / "summary.json").read_text())["digests"] for run in (plain, ramped)]
    assert digests[0]["site0"] != digests[1]["site0"]


def test_the_sync_mode_is_part_of_the_job_fingerprint():
    from isthmus.deploy.config.job import load_config

    step = load_config(None, []).fingerprint()
    diloco = load_config(None, ["sync.mode=diloco", "sync.inner_steps=20"]).fingerprint()
    assert step["sync.mode"] == "step" and diloco["sync.mode"] == "diloco"
    assert diloco["sync.inner_steps"] == "20"
    assert {"sync.outer_lr", "sync.outer_momentum", "sync.outer_delay"} <= set(diloco)
    ramped = load_config(None, ["sync.mode=diloco", "sync.outer_lr_ramp=1.5"]).fingerprint()
    assert (diloco["sync.outer_lr_ramp"], ramped["sync.outer_lr_ramp"]) == ("1.0", "1.5")
    streaming = load_config(
        None, ["sync.mode=streaming", "sync.inner_steps=40", "sync.fragments=4"]
    ).fingerprint()
    assert streaming["sync.fragments"] == "4" and streaming["sync.fragment_alpha"] == "0.5"


def test_the_modes_benchmark_reads_every_mode_and_refuses_a_bad_one():
    bench = load_benchmark("sync_modes")
    settings, steps = bench.mode_run("streaming:100:4:3@50", 400)
    assert steps == 50 and settings == [
        "--set", "sync.mode=streaming", "--set", "sync.inner_steps=100",
        "--set", "sync.fragments=4", "--set", "sync.outer_delay=3",
    ]  # fmt: skip
    assert bench.mode_run("diloco:20", 400) == (
        ["--set", "sync.mode=diloco", "--set", "sync.inner_steps=20"],
        400,
    )
    assert bench.mode_run("joined", 400) == (["--set", "sync.mode=step"], 400)
    with pytest.raises(SystemExit, match="streaming:H:P"):
        bench.mode_run("streaming:100", 400)
    with pytest.raises(SystemExit, match="joined"):
        bench.mode_run("joined:2", 400)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_modes_benchmark_compares_loss_with_the_joined_run_and_bytes_with_per_step(tmp_path):
    """`joined` (every rank in one site) is the loss baseline when present; a short
    per-step run beside it gives the bytes per token and is left out of the loss."""
    out = tmp_path / "modes"
    done = run_benchmark(
        "sync_modes", "--out", str(out),
        "--steps", "4", "--preset", "tiny", "--modes", "step@2,joined,diloco:2",
        "--set", "train.seq_len=64", "--eval-every", "4", "--eval-batches", "2", "--tail", "2",
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "sync_modes.json").read_text())
    assert result["loss_baseline"] == "joined" and result["loss_at_step"] == 4
    rows = result["rows"]
    joined_sites = sorted(p.name for p in (out / "joined" / "sites").iterdir())
    assert joined_sites == ["site0"] and rows["joined"]["cross_site_bytes"] == 0
    assert rows["step@2"]["steps"] == 2 and rows["step@2"]["loss_vs_step"] is None
    assert rows["joined"]["loss_vs_step"] == 0.0
    diloco = rows["diloco:2"]
    # The held-out curve, by steps taken (JSON keys): one measurement, the last.
    assert diloco["val_curve"] == {"4": diloco["val_loss"]} and diloco["val_loss"] > 0
    expected = diloco["loss_at_equal_tokens"] / rows["joined"]["loss_at_equal_tokens"] - 1
    assert diloco["loss_vs_step"] == pytest.approx(expected)
    # DiLoCo at H = 2 sends the fp32 model once per 2 steps: half per-step sync's bytes.
    assert diloco["fewer_bytes_than_step"] == pytest.approx(2.0, rel=0.05)
