"""Resuming a job from its checkpoints: the [checkpoint] config, the step a resumed
job starts at, and a real `isthmus local` run stopped and resumed (on the built-in
corpus and on shards `isthmus data prepare` wrote)."""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import sysconfig
from pathlib import Path

import pytest
from helpers import fake_checkpoint, run_cli

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.rank.checkpointing import common_step, resolve_resume, site_root
from isthmus.intra.corpus.tokenizer import TextTokenizer


def test_checkpoint_settings_stay_out_of_the_fingerprint_but_the_start_step_does_not() -> None:
    base = load_config().fingerprint()
    other = load_config(
        overrides=["checkpoint.every=5", "checkpoint.dir=/x", "checkpoint.keep=9"]
    ).fingerprint()
    assert base == other
    assert base["checkpoint.resume_step"] == "-1"
    resumed = load_config(overrides=["checkpoint.resume_step=3"]).fingerprint()
    assert resumed["checkpoint.resume_step"] == "3"


@pytest.mark.parametrize(
    "override, words",
    [
        ("checkpoint.every=-1", "checkpoint.every must be >= 0"),
        ("checkpoint.keep=-2", "checkpoint.keep must be >= 0"),
        ("checkpoint.resume_step=20", "below job.steps=20"),
    ],
)
def test_bad_checkpoint_settings_are_refused(override: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides=[override])


def test_resume_takes_the_newest_step_complete_at_any_site(tmp_path: Path) -> None:
    config = load_config(overrides=[f"run.run_dir={tmp_path}"])
    for site, steps in {"site0": [2, 4, 6], "site1": [2, 4]}.items():
        for step in steps:
            fake_checkpoint(site_root(config, tmp_path, site), step)
    # site1 will load site0's step 6: replicas are identical after every step.
    resolve_resume(config, config.site_names, resume=True)
    assert config.checkpoint.resume_step == 6
    # Retention spares the newest step that every site holds.
    assert common_step(config, tmp_path) == 4
    # One site alone (`isthmus site --resume`) takes its own newest.
    alone = load_config(overrides=[f"run.run_dir={tmp_path}"])
    resolve_resume(alone, ["site1"], resume=True)
    assert alone.checkpoint.resume_step == 4


def test_resume_refuses_clearly(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--resume needs --run-dir"):
        resolve_resume(load_config(), ["site0"], resume=True)
    config = load_config(overrides=[f"run.run_dir={tmp_path}", "job.steps=6"])
    with pytest.raises(ConfigError, match=r"--resume: no complete checkpoint under .*\*"):
        resolve_resume(config, config.site_names, resume=True)
    fake_checkpoint(site_root(config, tmp_path, "site0"), 6)
    with pytest.raises(ConfigError, match="nothing left to train"):
        resolve_resume(config, config.site_names, resume=True)
    named = load_config(overrides=[f"run.run_dir={tmp_path}", "checkpoint.resume_step=3"])
    with pytest.raises(ConfigError, match=r"resume_step=3: no complete checkpoint of it"):
        resolve_resume(named, named.site_names, resume=False)


def _site_lines(run_dir: Path, site: str) -> list[dict]:
    text = (run_dir / "sites" / site / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _prepared_data(tmp_path: Path) -> tuple[str, ...]:
    """`isthmus data prepare` run on a stdlib source file with a BPE trained here, in
    small shards (training windows cross their borders, intra/corpus/tokens.py ShardedTokens);
    returns the settings that train on them."""
    source = Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py"
    text = tmp_path / "encoder.txt"
    shutil.copy(source, text)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(TextTokenizer.train([text.read_text()], 300).json)
    data = tmp_path / "prepared"
    prepared = run_cli(
        *("data", "prepare", str(text), "--tokenizer", str(tokenizer), "--out", str(data)),
        *("--shard-tokens", "1500", "--quiet"),
        timeout=120,
    )
    assert prepared.returncode == 0, prepared.stderr
    assert len(json.loads((data / "manifest.json").read_text())["shards"]) > 3
    return (
        *("--set", "data.source=prepared", "--set", f"data.path={data}"),
        *("--set", f"data.tokenizer={data / 'tokenizer.json'}"),
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("layout", "prepared"),
    [
        # On memory-mapped shards `isthmus data prepare` wrote: the resumed run reads
        # exactly the tokens of the one that never stopped. (It was a test of its own,
        # the same job on another codec: two more runs that showed nothing more.)
        (("--ranks-per-site", "1", "--set", "model.preset=tiny"), True),
        # Experts split over two ranks: DTensors on a second mesh, saved and loaded.
        (("--ranks-per-site", "2", "--set", "model.preset=moe-tiny", "--set", "topology.ep=2"),
         False),
        # A batch that grows over the steps: the resumed step 3 takes its size and split
        # (3 micro-batches: 2 + 1) from the ramp and the checkpoint.
        (("--ranks-per-site", "1", "--set", "model.preset=tiny", "--set", "train.accumulate=2",
          "--set", "train.batch_schedule=ramp", "--set", "train.batch_ramp_steps=6",
          "--set", "train.batch_start=2"), False),
    ],
    ids=["dense-prepared-data", "moe-ep2", "ramp"],
)  # fmt: skip
def test_a_resumed_job_repeats_the_losses_of_one_that_never_stopped(
    tmp_path: Path, layout: tuple[str, ...], prepared: bool
) -> None:
    """2 sites, 6 steps, a checkpoint every 3; then resume from step 3.

    The int8 codec keeps error-feedback residuals, so they must come back from the
    checkpoint too. Everything a step computes is deterministic on CPU (same
    layout, same order of additions, data drawn from (seed, step)): the resumed
    steps must match bitwise, not within a tolerance.
    """
    run_dir = tmp_path / "run"
    common = [
        *("local", "--sites", "2", *layout, "--steps", "6"),
        *("--run-dir", str(run_dir), "--set", "train.seq_len=64"),
        *("--set", "checkpoint.every=3", "--set", "sync.codec=int8+zstd:1"),
        *("--set", "run.tensorboard=false", "--quiet"),
        # The held-out loss after the last step on one batch, not 16: no test here reads
        # it, and 16 cost each site seconds of forward passes on 2 cores in every run.
        *("--set", "run.eval_batches=1"),
        *(_prepared_data(tmp_path) if prepared else ()),
    ]
    first = run_cli(*common, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {s: _site_lines(run_dir, s) for s in ("site0", "site1")}
    assert [r["step"] for r in before["site0"]] == list(range(6))
    if "train.batch_schedule=ramp" in layout:  # 2 + 1 micro-batches of 8 from step 3
        assert [r["global_batch"] for r in before["site0"]] == [16, 16, 16, 24, 24, 24]
    digests = json.loads((run_dir / "summary.json").read_text())["digests"]
    assert len(set(digests.values())) == 1, digests  # identical replicas
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in (ckpt / "site0").iterdir()) == [
        "step-00000003",
        "step-00000006",
    ]
    # As if both sites had died before committing step 6: both resume from their own
    # step 3, residuals included.
    shutil.rmtree(ckpt / "site0" / "step-00000006")
    shutil.rmtree(ckpt / "site1" / "step-00000006")

    second = run_cli(*common, "--resume", timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    for site in ("site0", "site1"):
        after = _site_lines(run_dir, site)
        assert [r["step"] for r in after] == [3, 4, 5]
        assert [r["loss"] for r in after] == [r["loss"] for r in before[site][3:]]
        assert [r["grad_norm"] for r in after] == [r["grad_norm"] for r in before[site][3:]]
        batch = [r.get("global_batch") for r in before[site]]
        assert [r.get("global_batch") for r in after] == batch[3:]
    assert json.loads((run_dir / "summary.json").read_text())["digests"] == digests
    # The resumed run saved step 6 again at both sites.
    assert (ckpt / "site1" / "step-00000006" / "manifest.json").is_file()
    assert (ckpt / "site0" / "step-00000006" / "manifest.json").is_file()
    # A forged manifest at site1, which then loads site0's step 6: not under the ramp,
    # which has dense's one rank per site and tiny model and adds nothing to it.
    if "train.batch_schedule=ramp" not in layout:
        _resume_past_a_forged_manifest(run_dir, common)


def _resume_past_a_forged_manifest(run_dir: Path, common: list[str]) -> None:
    """Issue 33, row 10: one byte of a weight file of site1's newest checkpoint changed
    and the manifest's SHA-256 of it rewritten to match (sizes unchanged). The manifest
    is signed with the user's job token, so site1 refuses its copy and loads site0's.
    (A changed byte alone is refused for its hash: tests/intra/test_checkpoint.py.)"""
    ckpt = run_dir / "checkpoints"
    newest = ckpt / "site1" / "step-00000006"
    weights = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][weights.name]["sha256"] = hashlib.sha256(data).hexdigest()
    (newest / "manifest.json").write_text(json.dumps(manifest))
    # Issue 33, item 1: the run's files are its owner's alone.
    for path in (run_dir / "config.toml", weights, run_dir / "logs" / "site1-rank0.log"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in (ckpt, newest, run_dir / "sites" / "site0"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    third = run_cli(*common, "--resume", "--steps", "8", timeout=120)
    assert third.returncode == 0, third.stderr[-3000:]
    assert [r["step"] for r in _site_lines(run_dir, "site1")] == [6, 7]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(set(summary["digests"].values())) == 1 and summary["steps"] == 2
    log = (run_dir / "logs" / "site1-rank0.log").read_text()
    assert "manifest.json's signature does not match" in log
    assert "resumed from site0's checkpoint" in log
