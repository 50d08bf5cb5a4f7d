"""TP, PP, CP and FSDP composed inside one site, checked against one process (gloo, CPU).

Each layout runs one training step in spawned processes and compares the loss and
every gradient with an unsharded single-process reference on the same global
batch, and the evaluation forward (the held-out loss's) with the reference's loss. Two sites of tp=2 x dp=2 joined by real lanes: tests/e2e/test_local.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import RecordingSync, init_gloo, random_batches, shutdown, spawn

from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.layout import ParallelConfig, ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.model_config import Llama3RopeScaling, preset
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig, Trainer

SEED, SEQ, BATCH = 7, 16, 4
# Four layers so that pp=2 with two stages per rank (interleaved 1F1B) has one layer each.
MODEL = replace(preset("tiny"), n_layers=4)
# Mixture of experts of the same shape. The load-balancing loss is off here: it is a
# mean over each rank's own tokens (as in Megatron), so a sharded run's differs from
# one process's by design; tests/intra/test_moe.py checks it on its own.
MOE_MODEL = replace(preset("moe-tiny"), n_layers=4, aux_loss_coef=0.0)
# What the Llama, Qwen2 and Mistral families add (intra/hf_layout.py): grouped-query
# attention (2 key/value heads for 4 query heads), q/k/v biases, a head tied to the
# embedding, Llama 3's rotary scaling (its three frequency bands all present at this
# size). With pp > 1 the tied weight has a copy on the first and on the last stage
# (intra/tied.py), compared with the one process's one weight.
GQA_MODEL = replace(
    MODEL,
    n_kv_heads=2,
    qkv_bias=True,
    tie_embeddings=True,
    rope_scaling=Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=128
    ),
)
MODELS = {"dense": MODEL, "moe": MOE_MODEL, "gqa": GQA_MODEL}
# Steps taken after the compared one by a layout whose tied weight has two copies.
TIED_STEPS = 2
# Clip so large that it never scales: the recorded gradients are the raw ones.
CONFIG = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=10, grad_clip=1e6)

# Tolerances (fp32 everywhere). A sharded run computes the same sums in another
# order: TP splits each matmul's inner dimension (rowwise) and adds the partial
# products with an all-reduce; FSDP and the pipeline's micro-batches average the
# batch in pieces. Each reordering costs a few ulps of the *terms* summed, so the
# absolute error is set by the largest gradients (~0.07 here, fp32 ulp 7.5e-9),
# not by the entry itself: a near-cancelling entry of 1e-8 can be off by 2e-8.
# Context parallelism adds one more reordering (each query's softmax sums its keys
# in the gathered order), expert parallelism another (a token's expert outputs reach
# it through two all-to-alls and are summed per token), each of the same few ulps.
# Measured over all layouts below (2026-11-27, cp, moe and ep included): worst 3.0e-8
# absolute on a gradient (4 ulps of 0.07), 8.6e-8 relative on the loss, 4.9e-8
# relative on the gradient norm.
# Bounds: atol 1e-7 (~3x the worst) plus rtol 1e-5; loss and norm 1e-6 relative.
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-7}
LOSS_TOL = {"rtol": 1e-6, "atol": 0.0}


def _one_layout(rank: int, layout: dict, parallel: dict, model: str = "dense") -> dict[str, Any]:
    lay = ParallelLayout(**layout)
    config = ParallelConfig(**parallel)
    config.check(lay, MODELS[model], batch_size=BATCH, seq_len=SEQ)
    mesh = build_site_mesh(lay)
    sync = RecordingSync()
    trainer = Trainer(build_model(MODELS[model], SEED), mesh, CONFIG, parallel=config, sync=sync)
    _, dp_rank, _, _ = trainer.coordinate
    data = random_batches(SEQ, BATCH, SEED, dp_rank, lay.dp)
    # The held-out loss's forward (pipeline: the forward-only schedule) on the whole
    # global batch, every rank the same, before the step: the reference's loss.
    whole = random_batches(SEQ, BATCH * lay.dp, SEED)
    eval_loss = trainer.evaluate(*whole.batch(0))
    stats = trainer.step(0, *data.batch(0))
    # The hook fired exactly once per FSDP group (RecordingSync asserts no
    # repeats), also with pipeline micro-batches.
    hooks_ok = sorted(sync.shards) == list(range(len(trainer.groups)))
    grads = {
        name: p.grad.full_tensor()
        for part in trainer.model_parts
        for name, p in part.named_parameters()
    }
    tied = _train_tied_copy(trainer, data, sync) if trainer.tied is not None else None
    dist.barrier()
    return {
        "tied": tied,
        "loss": stats.loss,
        "eval_loss": eval_loss,
        "grad_norm": stats.grad_norm,
        "grads": grads,
        "hooks_ok": hooks_ok,
        "groups": len(trainer.groups),
        "coordinate": trainer.coordinate,
    }


def _train_tied_copy(
    trainer: Trainer, data: ShardedBatches, sync: RecordingSync
) -> dict[str, torch.Tensor]:
    """A few more steps, then this rank's copy of the tied weight and its AdamW state,
    whole (first or last stage: the test compares the two)."""
    for step in range(1, 1 + TIED_STEPS):
        sync.shards.clear()  # a new step: each group's hook fires once more
        trainer.step(step, *data.batch(step))
    assert trainer.tied is not None
    weight = trainer.tied.weight
    state = trainer.optimizer.state[weight]
    return {
        "weight": weight.full_tensor(),
        "exp_avg": state["exp_avg"].full_tensor(),
        "exp_avg_sq": state["exp_avg_sq"].full_tensor(),
    }


def _layouts_worker(rank: int, world: int, store: str, cases: dict) -> dict[str, Any]:
    # Several layouts in one set of processes: each builds its own mesh (new
    # subgroups) over the same world. Starting processes is most of the cost.
    init_gloo(rank, world, store)
    out = {name: _one_layout(rank, *case) for name, case in cases.items()}
    shutdown()
    return out


def _layout_worker(rank: int, world: int, store: str, layout: dict, parallel: dict) -> dict:
    return _layouts_worker(rank, world, store, {"case": (layout, parallel)})["case"]


def _reference(global_batch: int, model_name: str = "dense") -> dict[str, Any]:
    model = build_model(MODELS[model_name], SEED)
    data = random_batches(SEQ, global_batch, SEED)
    x, y = data.batch(0)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values()))
    return {"loss": loss.item(), "grads": grads, "grad_norm": norm.item()}


def _check_layout(ranks: list[dict], layout: dict, model: str = "dense") -> None:
    lay = ParallelLayout(**layout)
    ref = _reference(BATCH * lay.dp, model)
    assert sorted(r["coordinate"] for r in ranks) == sorted(
        (p, d, c, t)
        for p in range(lay.pp)
        for d in range(lay.dp)
        for c in range(lay.cp)
        for t in range(lay.tp)
    )
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        assert r["hooks_ok"], r["coordinate"]
        # Every rank reports the same site loss and norm (one all-reduce each).
        assert r["loss"] == ranks[0]["loss"] and r["grad_norm"] == ranks[0]["grad_norm"]
        assert r["eval_loss"] == ranks[0]["eval_loss"], r["coordinate"]
        for name, g in r["grads"].items():
            if name == "output.weight" and MODELS[model].tie_embeddings:
                # The head's copy of the tied weight: bitwise the embedding's gradient.
                name = "tok_embeddings.weight"
            if name in merged:  # dp/tp replicas of a stage gathered the same tensor
                assert torch.equal(merged[name], g), name
            merged[name] = g
    assert sorted(merged) == sorted(ref["grads"])
    torch.testing.assert_close(
        torch.tensor(ranks[0]["loss"]), torch.tensor(ref["loss"]), **LOSS_TOL
    )
    torch.testing.assert_close(
        torch.tensor(ranks[0]["grad_norm"]), torch.tensor(ref["grad_norm"]), **LOSS_TOL
    )
    # Trainer.evaluate: the same loss as the training forward, without the update.
    torch.testing.assert_close(
        torch.tensor(ranks[0]["eval_loss"]), torch.tensor(ref["loss"]), **LOSS_TOL
    )
    for name, g in ref["grads"].items():
        torch.testing.assert_close(merged[name], g, **GRAD_TOL, msg=name)


LAYOUTS_4 = {
    "dp4": ({"dp": 4}, {}),
    "tp4-sp": ({"tp": 4}, {"sequence_parallel": True}),
    "pp4-gpipe": ({"pp": 4}, {"schedule": "gpipe", "microbatches": 4}),
    "tp2xdp2-ac": ({"dp": 2, "tp": 2}, {"activation_checkpoint": True}),
    "pp2xdp2-1f1b": ({"pp": 2, "dp": 2}, {"schedule": "1f1b", "microbatches": 2}),
    "pp2xtp2-interleaved-sp": (
        {"pp": 2, "tp": 2},
        {"schedule": "interleaved_1f1b", "sequence_parallel": True},
    ),
    # Context parallelism: each sequence in 2*cp chunks, two per rank.
    "cp4": ({"cp": 4}, {}),
    "cp2xdp2": ({"dp": 2, "cp": 2}, {}),
    "cp2xtp2-sp": ({"cp": 2, "tp": 2}, {"sequence_parallel": True}),
    "pp2xcp2-1f1b": ({"pp": 2, "cp": 2}, {"schedule": "1f1b", "microbatches": 2}),
    # Mixture of experts (dropless top-2 of 4): experts sharded by FSDP like any weight.
    "moe-dp4": ({"dp": 4}, {}, "moe"),
    "moe-tp2xdp2": ({"dp": 2, "tp": 2}, {}, "moe"),
    "moe-pp2xcp2": ({"pp": 2, "cp": 2}, {"schedule": "1f1b", "microbatches": 2}, "moe"),
    # Expert parallelism: the 4 experts split over ep consecutive dp ranks, tokens
    # exchanged all-to-all, each block's experts an FSDP group of their own.
    "moe-ep4": ({"dp": 4}, {"expert_parallel": 4}, "moe"),
    "moe-dp4-ep2": ({"dp": 4}, {"expert_parallel": 2}, "moe"),
    "moe-tp2xdp2-ep2": ({"dp": 2, "tp": 2}, {"expert_parallel": 2}, "moe"),
    "moe-dp2xcp2-ep2": ({"dp": 2, "cp": 2}, {"expert_parallel": 2}, "moe"),
    "moe-pp2xdp2-ep2": (
        {"pp": 2, "dp": 2},
        {"schedule": "1f1b", "microbatches": 2, "expert_parallel": 2},
        "moe",
    ),
    # Grouped-query attention, q/k/v biases, tied head: FSDP with tp, cp and pp.
    "gqa-tp2xdp2": ({"dp": 2, "tp": 2}, {}, "gqa"),
    "gqa-cp2xtp2-sp": ({"cp": 2, "tp": 2}, {"sequence_parallel": True}, "gqa"),
    # The tied weight on the first and the last stage, sharded by FSDP or by tp.
    "gqa-pp2xdp2-1f1b": ({"pp": 2, "dp": 2}, {"schedule": "1f1b", "microbatches": 2}, "gqa"),
    "gqa-pp2xtp2-interleaved-sp": (
        {"pp": 2, "tp": 2},
        {"schedule": "interleaved_1f1b", "sequence_parallel": True},
        "gqa",
    ),
}


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("layouts4")
    ranks = spawn(_layouts_worker, 4, tmp, 4, str(tmp / "store"), LAYOUTS_4, timeout=200)
    return {name: [r[name] for r in ranks] for name in LAYOUTS_4}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(LAYOUTS_4))
def test_layout_4_ranks_matches_one_process(four_rank_results: dict, case: str) -> None:
    layout, _, *model = LAYOUTS_4[case]
    _check_layout(four_rank_results[case], layout, *model)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["gqa-pp2xdp2-1f1b", "gqa-pp2xtp2-interleaved-sp"])
def test_tied_copies_stay_bitwise_equal_over_steps(four_rank_results: dict, case: str) -> None:
    # The first stage's embedding and the last stage's head, at each dp/tp coordinate,
    # after 1 + TIED_STEPS optimizer steps: one weight and one AdamW state, bit for bit,
    # and moved from where both started.
    start = build_model(GQA_MODEL, SEED).tok_embeddings.weight.detach()
    copies = {r["coordinate"]: r["tied"] for r in four_rank_results[case]}
    for (pp, *rest), mine in copies.items():
        if pp == 0:
            theirs = copies[(1, *rest)]
            for key, value in mine.items():
                assert torch.equal(value, theirs[key]), (rest, key)
            assert not torch.equal(mine["weight"], start)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pp2_dp2_tp2_interleaved_matches_one_process(tmp_path: Path) -> None:
    layout = {"pp": 2, "dp": 2, "tp": 2}
    parallel = {"schedule": "interleaved_1f1b", "microbatches": 4, "activation_checkpoint": True}
    ranks = spawn(
        _layout_worker, 8, tmp_path, 8, str(tmp_path / "s"), layout, parallel, timeout=200
    )
    _check_layout(ranks, layout)
