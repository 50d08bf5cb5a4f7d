"""Multi-process tests of isthmus.intra on real gloo process groups.

Each worker is a spawned process with one thread; results come back through
``torch.save`` files. The references run in the pytest process itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import (
    AveragingSync,
    RecordingSync,
    init_gloo,
    random_batches,
    shutdown,
    site_world,
    spawn,
)

from isthmus.intra.digest import parameter_digest
from isthmus.intra.layout import ParallelConfig, ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.model_config import preset
from isthmus.intra.parallel import apply_fsdp
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import GradientSync, TrainConfig, Trainer

SEED, SEQ, BATCH, STEPS = 5, 32, 2, 3
# Large clip so clipping multiplies by exactly 1 and the recorded shards stay comparable.
CONFIG = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=10, grad_clip=1e6)
# Parameters after 3 AdamW steps. Adam's update lr * m / (sqrt(v) + eps) is
# ~ lr * sign(g) once |g| >> eps, but where |g| is within a few orders of eps=1e-8
# (some grads here are ~1e-10) an ulp-level absolute grad difference (~1e-9 for
# entries up to 4e-2) moves the update by a visible fraction of lr. Measured:
# 1.1e-5 worst case (0.4% of lr) on a handful of elements; bound it at 1% of lr.
PARAM_TOL = {"rtol": 1e-5, "atol": 0.01 * CONFIG.lr}


def _group_params(model: torch.nn.Module, group: int) -> list[torch.nn.Parameter]:
    if group < len(model.layers):
        return list(model.layers[str(group)].parameters())
    return [p for n, p in model.named_parameters() if not n.startswith("layers.")]


def _dp_worker(rank: int, world: int, store: str, record: bool) -> dict[str, Any]:
    init_gloo(rank, world, store)
    mesh = build_site_mesh(ParallelLayout(dp=world))
    model = build_model(preset("tiny"), SEED)
    initial = parameter_digest(model)
    sync = RecordingSync() if record else None
    trainer = Trainer(model, mesh, CONFIG, sync=sync)
    data = random_batches(SEQ, BATCH, SEED, rank, world)
    result: dict[str, Any] = {"initial": initial, "losses": [], "shard_checks": []}
    for step in range(STEPS):
        if sync is not None:
            sync.shards, sync.seen, sync.steps = {}, {}, []
        result["losses"].append(trainer.step(step, *data.batch(step)).loss)
        if sync is None:
            continue
        assert sorted(sync.shards) == list(range(len(trainer.groups)))
        # Every round of the step is named by the step, and finish comes last.
        groups = len(trainer.groups)
        assert sync.steps == [("start", step)] * groups + [("finish", step)], sync.steps
        for g, shard in sync.shards.items():
            grads = [p.grad.to_local() for p in _group_params(model, g)]
            result["shard_checks"] += [
                # FSDP2 did not rescale the shard after the hook returned (the
                # shard was already the dp average when start() saw it) ...
                torch.equal(sync.seen[g], torch.cat([t.reshape(-1) for t in grads])),
                # ... and the sharded grads are views of the hook's tensor.
                all(
                    t.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
                    for t in grads
                ),
            ]
        if step == 0:
            result["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    result["params"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    result["digest"] = parameter_digest(model)
    shutdown()
    return result


def _reference(global_batch: int) -> dict[str, Any]:
    """Single process, unsharded model, the whole global batch, the same optimizer."""
    torch.manual_seed(0)
    model = build_model(preset("tiny"), SEED)
    opt = torch.optim.AdamW(
        model.parameters(), lr=CONFIG.lr, betas=CONFIG.betas, weight_decay=CONFIG.weight_decay
    )
    data = random_batches(SEQ, global_batch, SEED)
    out: dict[str, Any] = {"losses": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG.grad_clip)
        for g in opt.param_groups:
            g["lr"] = CONFIG.lr_at(step)
        opt.step()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _init_worker(rank: int, world: int, store: str) -> tuple[str, str]:
    init_gloo(rank, world, store)
    model = build_model(preset("tiny"), SEED)
    before = parameter_digest(model)
    apply_fsdp(model, build_site_mesh(ParallelLayout(dp=world)))
    after = parameter_digest(model)  # collective: gathers the shards
    shutdown()
    return before, after


@pytest.mark.timeout(120)
def test_init_identical_across_processes_and_shardings(tmp_path: Path) -> None:
    results = spawn(_init_worker, 2, tmp_path, 2, str(tmp_path / "store"))
    expected = parameter_digest(build_model(preset("tiny"), SEED))
    assert {d for pair in results for d in pair} == {expected}


@pytest.mark.timeout(120)
def test_fsdp_dp2_matches_unsharded_reference(tmp_path: Path) -> None:
    ranks = spawn(_dp_worker, 2, tmp_path, 2, str(tmp_path / "store"), True)
    ref = _reference(global_batch=2 * BATCH)
    # fp32 throughout; the sharded run only sums the batch in a different order
    # (two half-batch means averaged by the reduce-scatter), so differences are
    # a few ulps of the values: 1e-5 relative with a 1e-7 floor for near-zero grads.
    tol = {"rtol": 1e-5, "atol": 1e-7}
    for r in ranks:
        assert r["shard_checks"] and all(r["shard_checks"])
        assert r["losses"] == ranks[0]["losses"]
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=0
        )
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, **tol, msg=name)
        for name, p in ref["params"].items():
            torch.testing.assert_close(r["params"][name], p, **PARAM_TOL, msg=name)
    assert ranks[0]["digest"] == ranks[1]["digest"]


def _uncommitted_worker(rank: int, world: int, store: str, offload: bool) -> dict[str, Any]:
    init_gloo(rank, world, store)
    model = build_model(preset("tiny"), SEED)
    sync = RecordingSync(commit=False)
    mesh = build_site_mesh(ParallelLayout(dp=world))
    parallel = ParallelConfig(offload=offload)
    trainer = Trainer(model, mesh, CONFIG, parallel=parallel, sync=sync)
    data = random_batches(SEQ, BATCH, SEED, rank, world)
    before = parameter_digest(model)
    stats = trainer.step(0, *data.batch(0))
    after = parameter_digest(model)
    untouched_state = sum(len(v) for v in trainer.optimizer.state.values())
    # The same step again once the sync commits: it trains as if the first never ran.
    sync.commit, sync.shards = True, {}
    committed = trainer.step(0, *data.batch(0))
    out = {
        "before": before,
        "after": after,
        "committed": (stats.committed, committed.committed),
        "grad_norm": stats.grad_norm,
        "optimizer_state": (untouched_state, sum(len(v) for v in trainer.optimizer.state.values())),
        "trained": parameter_digest(model),
        "loss": (stats.loss, committed.loss),
    }
    shutdown()
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_a_step_whose_sync_did_not_commit_changes_nothing(tmp_path: Path, offload: bool) -> None:
    """A lane's sync says REJOIN when the job went on without this site: the trainer
    must then leave parameters and optimizer state as they were (the site pulls the
    live state next); the step it runs once the sync commits trains normally."""
    ranks = spawn(_uncommitted_worker, 2, tmp_path, 2, str(tmp_path / "store"), offload)
    for r in ranks:
        assert r["committed"] == (False, True)
        assert r["after"] == r["before"]
        assert r["grad_norm"] == 0.0
        assert r["trained"] != r["before"]  # the committed step did move the model
        assert r["loss"][0] == r["loss"][1]  # same batch, same untouched parameters
        assert r["optimizer_state"][0] == 0 < r["optimizer_state"][1]  # AdamW never stepped


def _site_worker(site: int, sites: int, tmp: str) -> dict[str, Any]:
    cross = site_world(site, sites, tmp)
    mesh = build_site_mesh(ParallelLayout(dp=1))
    model = build_model(preset("tiny"), SEED)
    sync = AveragingSync(cross, sites)
    assert isinstance(sync, GradientSync)
    trainer = Trainer(model, mesh, CONFIG, sync=sync)
    data = random_batches(SEQ, BATCH, SEED, site, sites)
    losses = [trainer.step(s, *data.batch(s)).loss for s in range(STEPS)]
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    digest = parameter_digest(model)
    shutdown()
    return {"losses": losses, "params": params, "digest": digest}


@pytest.mark.timeout(120)
def test_gradient_sync_two_sites_match_one_site_two_ranks(tmp_path: Path) -> None:
    one_site = spawn(_dp_worker, 2, tmp_path, 2, str(tmp_path / "store"), False)[0]
    sites = spawn(_site_worker, 2, tmp_path, 2, str(tmp_path))
    # Invariant 1: every site applied the same update, bit for bit.
    assert sites[0]["digest"] == sites[1]["digest"]
    # Each site's loss is over its half of the global batch; their mean is the
    # one-site loss. Same fp32 math in a different reduction order: 1e-6 relative.
    mean_losses = [(a + b) / 2 for a, b in zip(sites[0]["losses"], sites[1]["losses"], strict=True)]
    torch.testing.assert_close(
        torch.tensor(mean_losses), torch.tensor(one_site["losses"]), rtol=1e-6, atol=0
    )
    for name, p in one_site["params"].items():
        torch.testing.assert_close(sites[0]["params"][name], p, **PARAM_TOL, msg=name)


def _evaluate_worker(rank: int, world: int, store: str) -> float:
    init_gloo(rank, world, store)
    trainer = Trainer(
        build_model(preset("tiny"), SEED), build_site_mesh(ParallelLayout(dp=world)), CONFIG
    )
    batch = random_batches(SEQ, BATCH, SEED).batch(0)
    loss = trainer.evaluate(*batch)  # the same batch on both ranks
    shutdown()
    return loss


def test_evaluate_gives_the_unsharded_models_loss_on_every_rank(tmp_path: Path) -> None:
    losses = spawn(_evaluate_worker, 2, tmp_path, 2, str(tmp_path / "store"))
    inputs, targets = random_batches(SEQ, BATCH, SEED).batch(0)
    with torch.no_grad():
        logits = build_model(preset("tiny"), SEED)(inputs)
        want = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert losses[0] == losses[1]
    assert abs(losses[0] - want) < 1e-5
