"""A job on data `isthmus data prepare` wrote, through the real CLI: two sites train on
the memory-mapped shards to identical replicas, and a run stopped and resumed reads
exactly the tokens of one that never stopped (its losses match bitwise)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
from helpers import run_cli

from isthmus.intra.tokenizer import TextTokenizer


def _losses(run_dir: Path, site: str) -> list[tuple[int, float]]:
    lines = (run_dir / "sites" / site / "metrics.jsonl").read_text().splitlines()
    return [(row["step"], row["loss"]) for row in map(json.loads, lines)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sites_train_on_prepared_shards_and_resume_exactly(tmp_path: Path) -> None:
    source = Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py"
    text = tmp_path / "encoder.txt"
    shutil.copy(source, text)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(TextTokenizer.train([text.read_text()], 300).json)
    data = tmp_path / "prepared"
    # Small shards: training windows cross their borders (intra/data.py ShardedTokens).
    prepared = run_cli(
        *("data", "prepare", str(text), "--tokenizer", str(tokenizer), "--out", str(data)),
        *("--shard-tokens", "1500", "--quiet"),
        timeout=120,
    )
    assert prepared.returncode == 0, prepared.stderr
    assert len(json.loads((data / "manifest.json").read_text())["shards"]) > 3

    run_dir = tmp_path / "run"
    common = [
        *("local", "--sites", "2", "--ranks-per-site", "1", "--steps", "6"),
        *("--run-dir", str(run_dir), "--set", "model.preset=tiny"),
        *("--set", "train.seq_len=64", "--set", "checkpoint.every=3"),
        *("--set", "data.source=prepared", "--set", f"data.path={data}"),
        *("--set", f"data.tokenizer={data / 'tokenizer.json'}"),
        *("--set", "run.tensorboard=false", "--quiet"),
    ]
    first = run_cli(*common, timeout=150)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(set(summary["digests"].values())) == 1, summary["digests"]  # identical replicas
    before = {s: _losses(run_dir, s) for s in ("site0", "site1")}
    assert [step for step, _ in before["site0"]] == list(range(6))

    for site in ("site0", "site1"):  # as if both died before committing step 6
        shutil.rmtree(run_dir / "checkpoints" / site / "step-00000006")
    second = run_cli(*common, "--resume", timeout=150)
    assert second.returncode == 0, second.stderr[-3000:]
    for site in ("site0", "site1"):
        assert _losses(run_dir, site) == before[site][3:]
    assert json.loads((run_dir / "summary.json").read_text())["digests"] == summary["digests"]
