"""Weights in and out in the Hugging Face layout: `model.init_from` trains on from a
``transformers`` model folder and `isthmus export --to hf` writes one that
``transformers`` loads with the same logits. Nothing is downloaded: the models are
tiny and random, built from a local config."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers  # the dev extra installs it; never a runtime dependency
from helpers import assert_one_line_error, job_corpus, run_cli

from isthmus.deploy.config.job import load_config
from isthmus.deploy.security.trust import checkpoint_key
from isthmus.intra import checkpoint
from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.digest import parameter_digest
from isthmus.intra.model import build_model
from isthmus.intra.pipeline import split_stage

# A Qwen2 with all that the families add but rope scaling (tests/intra/test_hf_layout.py
# has that): grouped-query attention, q/k/v biases, a tied head. Byte vocabulary, so
# the job's default tokenizer fits it.
QWEN2 = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
# fp32. Logits of one set of weights through transformers and isthmus: bitwise equal
# (tests/intra/test_hf_layout.py), bound 1e-5. The job's first loss against
# transformers' on the same batch: the job ran tp=2, whose row-parallel matmuls add
# their halves in another order, and pp=2, whose micro-batches average the batch in
# two halves, a few ulps of the loss (~5.5): bound 1e-5 relative.
LOGITS_TOL = {"atol": 1e-5, "rtol": 0.0}
LOSS_TOL = {"atol": 0.0, "rtol": 1e-5}


def hf_folder(folder: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2)).float().eval()
    with torch.no_grad():  # HF's init leaves biases at 0 and norms at 1: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return model


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_train_from_hf_weights_then_export_them_back(tmp_path: Path) -> None:
    start = hf_folder(tmp_path / "start")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 1000)
    run = tmp_path / "run"
    # The smallest job that shards a checkpoint by tp and by pipeline stage (the tied
    # head's copy on the last, intra/tied.py): one site of pp=2 x tp=2, one step, saved.
    job = [
        "--sites", "1", "--ranks-per-site", "4", "--steps", "1", "--run-dir", str(run),
        "--set", "topology.tp=2", "--set", "topology.pp=2",
        "--set", f"model.init_from={tmp_path / 'start'}",
        "--set", "train.seq_len=32", "--set", "train.batch_size=2",
        "--set", "data.source=path", "--set", f"data.path={corpus}",
        "--quiet",  # no checkpoint.every: the final checkpoint is kept
    ]  # fmt: skip
    result = run_cli("local", *job, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    # init_from: the job's first loss is transformers' on the job's first batch.
    config = load_config(run / "config.toml")
    data, split = job_corpus(config)
    batches = ShardedBatches(data, seq_len=32, batch_size=2, seed=0, spans=split.train)
    inputs, targets = batches.batch(0)
    with torch.no_grad():
        expected = F.cross_entropy(start(inputs).logits.flatten(0, 1), targets.flatten())
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0
    torch.testing.assert_close(torch.tensor(first["loss"]), expected, **LOSS_TOL)

    # export: the real CLI, from the run folder (its newest checkpoint, tp-sharded).
    out = tmp_path / "exported"
    result = run_cli("export", str(run), "--to", "hf", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step-00000001" in result.stdout
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tmp_path / "start" / "config.json").read_text()
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    # isthmus's model on the checkpoint: its whole parameters, gathered from the tp
    # shards and the stages, are the job's (the digest the run reported of its final
    # weights: with pp, sha256 over each stage's digest, the tied weight in both).
    ours = build_model(config.resolved_model(), seed=1)
    saved = checkpoint.full_parameters(
        run / "checkpoints" / "site0" / "step-00000001",
        checkpoint_key(config.security, config.checkpoint),
    )
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(saved.pop(name))
    assert not saved
    summary = json.loads((run / "summary.json").read_text())
    stages = "".join(parameter_digest(split_stage(ours, s, 2)) for s in range(2))
    assert hashlib.sha256(stages.encode()).hexdigest() == summary["digests"]["site0"]
    with torch.no_grad():
        logits = ours(inputs)
        torch.testing.assert_close(theirs(inputs).logits, logits, **LOGITS_TOL)
        # ... and they are the trained weights, not the ones the job started from.
        assert (start(inputs).logits - logits).abs().max() > 1e-3

    # Bad input, one line, nothing written: an existing folder, a run without checkpoints.
    assert_one_line_error(run_cli("export", str(run), "--to", "hf", str(out)), "not an empty")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.toml").write_text(config.to_toml())
    missing = tmp_path / "never"
    assert_one_line_error(
        run_cli("export", str(empty), "--to", "hf", str(missing)), "holds no complete checkpoint"
    )
    assert not missing.exists()


@pytest.mark.parametrize(
    ("change", "flags", "words"),
    [
        # Another family: the line names it, the families and the fields they need.
        (
            {"model_type": "gpt2"},
            [],
            ["model_type 'gpt2' is not supported", "llama, qwen2, mistral", "hidden_size"],
        ),
        # Whole key/value heads per tp rank: 2 of them cannot split 4 ways.
        ({}, ["--set", "topology.tp=4"], ["n_kv_heads=2", "tp=4"]),
        ({"max_position_embeddings": 16}, [], ["train.seq_len=32 exceeds the 16 positions"]),
    ],
)
def test_a_config_json_isthmus_cannot_build_is_refused_in_one_line(
    tmp_path: Path, change: dict, flags: list[str], words: list[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", **QWEN2, **change}))
    argv = ["--ranks-per-site", "4", "--set", "train.seq_len=32"]
    argv += ["--set", f"model.hf_config={config}", *flags]
    assert_one_line_error(run_cli("config", *argv, timeout=60), *words)
