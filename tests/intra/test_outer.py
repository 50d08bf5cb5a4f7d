"""DiLoCo's outer optimizer on real gloo process groups: two one-rank sites whose
"WAN" is a gloo group of their own (the lanes are tested end to end in test_sync_modes)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import (
    AveragingSync,
    RecordingSync,
    init_gloo,
    random_batches,
    shutdown,
    site_world,
    spawn,
)

from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.digest import parameter_digest
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.model_config import preset
from isthmus.intra.outer import OuterConfig, OuterOptimizer
from isthmus.intra.outer_groups import fragment_of, outer_groups
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig, Trainer

SEED, SEQ, BATCH = 5, 32, 2
INNER = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=20)


class FailingSync:
    """A cross-site sync whose round fails: finish raises after start saw the shards."""

    def __init__(self) -> None:
        self.started: list[int] = []

    def start(self, step: int, group: int, shard: torch.Tensor) -> None:
        self.started.append(group)
        shard.fill_(float("nan"))  # a failed round may have scribbled on its buffers

    def finish(self, step: int) -> None:
        raise RuntimeError("the round failed")


class VotingAheadSync(AveragingSync):
    """AveragingSync that also records the steps the outer optimizer voted ahead on
    (``LaneGradientSync.vote_ahead``: the rounds started, their finish steps away)."""

    def __init__(self, pg: dist.ProcessGroup, sites: int) -> None:
        super().__init__(pg, sites)
        self.voted_ahead: list[int] = []

    def vote_ahead(self, step: int) -> None:
        assert self.pending, "voted ahead before the round's groups started"
        self.voted_ahead.append(step)


def _site(
    site: int, tmp: str, inner: TrainConfig = INNER
) -> tuple[Trainer, ShardedBatches, dist.ProcessGroup]:
    cross = site_world(site, 2, tmp)
    trainer = Trainer(
        build_model(preset("tiny"), SEED), build_site_mesh(ParallelLayout(dp=1)), inner
    )
    data = random_batches(SEQ, BATCH, SEED, site, 2)
    return trainer, data, cross


def _leave(trainer: Trainer, **results: Any) -> dict[str, Any]:
    """A site's last act: ``results`` and its parameters' digest (a collective), then
    it leaves its groups."""
    digest = parameter_digest(trainer.model)
    shutdown()
    return {**results, "digest": digest}


def _flat_params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for g in outer_groups(trainer) for _, t in g])


def _mean_over_sites(t: torch.Tensor, cross: dist.ProcessGroup) -> torch.Tensor:
    both = [torch.empty_like(t) for _ in range(2)]
    cross.allgather([both], [t.contiguous()]).wait()
    return (both[0] + both[1]) / 2


def _averaging_worker(site: int, tmp: str) -> dict[str, Any]:
    """H = 1, outer lr 1, momentum 0: each outer step must average the sites' parameters."""
    trainer, data, cross = _site(site, tmp)
    sync = VotingAheadSync(cross, 2)
    outer = OuterOptimizer(
        trainer, sync, OuterConfig(inner_steps=1, lr=1.0, momentum=0.0), total_steps=3
    )
    errors = []
    for step in range(3):
        trainer.step(step, *data.batch(step))
        assert outer.due(step)
        expected = _mean_over_sites(_flat_params(trainer), cross)
        assert outer.step(step)  # landed
        errors.append(float((_flat_params(trainer) - expected).abs().max()))
    digest = parameter_digest(trainer.model)
    shutdown()
    # Without a delay each round lands at once: nothing to vote on ahead.
    assert sync.voted_ahead == []
    return {"errors": errors, "digest": digest, "outer_steps": outer.outer_steps}


@pytest.mark.timeout(120)
def test_h1_outer_lr_1_no_momentum_averages_parameters_every_step(tmp_path: Path) -> None:
    sites = spawn(_averaging_worker, 2, tmp_path, str(tmp_path))
    assert sites[0]["digest"] == sites[1]["digest"]  # replicas equal after every outer step
    assert sites[0]["outer_steps"] == 3
    # anchor - (anchor - mean) in fp32: a few ulps of parameters of size ~1e-1.
    assert max(sites[0]["errors"] + sites[1]["errors"]) < 1e-6


def _nesterov_worker(site: int, tmp: str, ramp: float = 1.0) -> dict[str, Any]:
    """H = 2 with momentum: the anchor follows torch.optim.SGD(nesterov=True) fed the
    mean outer gradient, and the parameters land on the anchor. With ``ramp``, SGD's
    learning rate is set before each outer step to what the ramp says at that step of a
    5-step inner schedule (its cosine ends at the last step)."""
    trainer, data, cross = _site(site, tmp, TrainConfig(lr=3e-3, warmup_steps=1, total_steps=5))
    config = OuterConfig(inner_steps=2, lr=0.7, momentum=0.9, lr_ramp=ramp)
    outer = OuterOptimizer(trainer, AveragingSync(cross, 2), config, total_steps=5)
    reference = torch.nn.Parameter(_flat_params(trainer))
    sgd = torch.optim.SGD([reference], lr=config.lr, momentum=config.momentum, nesterov=True)
    errors, due, lrs = [], [], []
    for step in range(5):
        trainer.step(step, *data.batch(step))
        due.append(outer.due(step))
        if not outer.due(step):
            continue
        reference.grad = _mean_over_sites(reference.detach() - _flat_params(trainer), cross)
        lrs.append(outer.lr_at(step))
        # Warmup 1, then a cosine over steps 1..5: decayed 0, 1/2 and 0.854 at 1, 3, 4.
        decayed = 0.5 * (1 - math.cos(math.pi * (step - 1) / 4))
        sgd.param_groups[0]["lr"] = config.lr * (1 + (ramp - 1) * decayed)
        sgd.step()
        assert outer.step(step) and not outer.in_flight
        errors.append(float((_flat_params(trainer) - reference.detach()).abs().max()))
        anchor = torch.cat(outer.anchor)
        assert torch.equal(anchor, _flat_params(trainer))
    state = {k: v.clone() for k, v in outer.state_dict().items()}
    return _leave(trainer, errors=errors, due=due, state=state, lrs=lrs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ramp", [1.0, 2.5])
def test_outer_step_is_nesterov_sgd_on_the_mean_outer_gradient(tmp_path: Path, ramp: float) -> None:
    """Also with sync.outer_lr_ramp: the outer lr rises as the inner cosine decays."""
    sites = spawn(_nesterov_worker, 2, tmp_path, str(tmp_path), ramp)
    expected = [0.7, 0.7 * (1 + (ramp - 1) * 0.5), 0.7 * (1 + (ramp - 1) * 0.8535534)]
    assert sites[0]["lrs"] == pytest.approx(expected, rel=1e-6)
    if ramp == 1.0:
        assert sites[0]["lrs"] == [0.7] * 3  # exactly the configured lr, no arithmetic
    # Every H = 2 steps, and the last step (index 4) of a 5-step job.
    assert sites[0]["due"] == [False, True, False, True, True]
    assert sites[0]["digest"] == sites[1]["digest"]
    # The same math in another order (torch's SGD vs in-place foreach-free ops).
    assert len(sites[0]["errors"]) == 3 and max(sites[0]["errors"]) < 1e-6
    for name, value in sites[0]["state"].items():
        assert torch.equal(value, sites[1]["state"][name]), name  # anchors and momentum agree
    assert any(v.abs().sum() > 0 for k, v in sites[0]["state"].items() if "momentum" in k)


def _failure_worker(rank: int, tmp: str) -> dict[str, Any]:
    init_gloo(0, 1, os.path.join(tmp, "one"))
    trainer = Trainer(
        build_model(preset("tiny"), SEED), build_site_mesh(ParallelLayout(dp=1)), INNER
    )
    data = random_batches(SEQ, BATCH, SEED)
    out: dict[str, Any] = {}
    try:
        with pytest.raises(ValueError, match="must not sync gradients itself"):
            OuterOptimizer(
                Trainer(
                    build_model(preset("tiny"), SEED),
                    build_site_mesh(ParallelLayout(dp=1)),
                    INNER,
                    sync=FailingSync(),
                ),
                FailingSync(),
                OuterConfig(),
                total_steps=1,
            )
        sync = FailingSync()
        outer = OuterOptimizer(trainer, sync, OuterConfig(inner_steps=1), total_steps=2)
        trainer.step(0, *data.batch(0))
        params = _flat_params(trainer)
        state = {k: v.clone() for k, v in outer.state_dict().items()}
        with pytest.raises(RuntimeError, match="the round failed"):
            outer.step(0)
        out["groups_started"] = len(sync.started)
        out["params_kept"] = torch.equal(params, _flat_params(trainer))
        out["state_kept"] = torch.equal(
            torch.cat(outer.anchor), torch.cat([state[f"outer/anchor/{i}"] for i in range(3)])
        ) and all(float(m.abs().sum()) == 0 for m in outer.momentum)
        with pytest.raises(RuntimeError, match="in flight"):
            outer.state_dict()  # the failed round's outer gradients are in no state
        outer.reset()
        # A state with a wrong shape is refused before anything is copied.
        bad = dict(state)
        bad["outer/anchor/0"] = torch.zeros(3)
        before = {k: v.clone() for k, v in outer.state_dict().items()}
        with pytest.raises(ValueError, match=r"outer/anchor/0.*shape \(3,\)"):
            outer.load_state_dict(
                {**bad, "outer/momentum/0": torch.ones_like(state["outer/momentum/0"])}
            )
        out["refusal_kept"] = all(torch.equal(v, outer.state_dict()[k]) for k, v in before.items())
        # A round the job did not commit (this site is to rejoin): nothing changes, the
        # round stays in flight, and the result says so.
        rejoining = RecordingSync(commit=False)
        outer = OuterOptimizer(trainer, rejoining, OuterConfig(inner_steps=1), total_steps=2)
        params = _flat_params(trainer)
        anchors = torch.cat(outer.anchor).clone()
        result = outer.step(0)
        out["rejoin_result"] = result is not None and not result.committed
        out["rejoin_kept"] = (
            torch.equal(params, _flat_params(trainer))
            and torch.equal(anchors, torch.cat(outer.anchor))
            and outer.in_flight
            and outer.outer_steps == 0
            and rejoining.steps == [("start", 0)] * 3 + [("finish", 0)]
        )
        # No outer entries (a state saved in per-step mode): a fresh outer loop.
        outer.momentum[0].fill_(1.0)
        out["fresh"] = outer.load_state_dict({"codec/x": torch.zeros(1)}) is False
        out["fresh_anchor"] = torch.equal(torch.cat(outer.anchor), _flat_params(trainer))
        out["fresh_momentum"] = all(float(m.abs().sum()) == 0 for m in outer.momentum)
        out["groups"] = len(outer.groups)
    finally:
        shutdown()
    return out


@pytest.mark.timeout(120)
def test_a_failed_outer_round_changes_nothing_and_bad_state_is_refused(tmp_path: Path) -> None:
    (out,) = spawn(_failure_worker, 1, tmp_path, str(tmp_path))
    # tiny has 2 blocks, then the embedding, final norm and head.
    assert out["groups"] == out["groups_started"] == 3
    assert out["params_kept"] and out["state_kept"] and out["refusal_kept"]
    assert out["rejoin_result"] and out["rejoin_kept"]
    assert out["fresh"] and out["fresh_anchor"] and out["fresh_momentum"]


def _delayed_worker(site: int, tmp: str) -> dict[str, Any]:
    """H = 3, delay 2: each round lands two steps after its outer gradients were taken,
    as the new anchor plus the progress this site made meanwhile."""
    trainer, data, cross = _site(site, tmp)
    config = OuterConfig(inner_steps=3, lr=0.7, momentum=0.9, delay=2)
    sync = VotingAheadSync(cross, 2)
    outer = OuterOptimizer(trainer, sync, config, total_steps=9)
    anchor = torch.nn.Parameter(_flat_params(trainer))
    sgd = torch.optim.SGD([anchor], lr=config.lr, momentum=config.momentum, nesterov=True)
    landed, errors, anchor_digests, taken = [], [], [], None
    for step in range(9):
        trainer.step(step, *data.batch(step))
        expected = None
        if outer.lands(step):
            now, (at, own) = _flat_params(trainer), taken
            anchor.grad = _mean_over_sites(own, cross)
            sgd.step()
            expected = anchor.detach() + (now - at)  # new anchor + progress since
        if outer.due(step):
            at = _flat_params(trainer)
            taken = (at, anchor.detach() - at)
            if step == 8:  # the job's last round lands at once, with no progress since
                anchor.grad = _mean_over_sites(taken[1], cross)
                sgd.step()
                expected = anchor.detach().clone()
        if outer.step(step):
            landed.append(step)
            if expected is not None:
                errors.append(float((_flat_params(trainer) - expected).abs().max()))
            assert torch.allclose(torch.cat(outer.anchor), anchor.detach(), rtol=0, atol=1e-6)
            anchor_digests.append(outer.anchor_digest())
    return _leave(
        trainer, landed=landed, errors=errors, anchors=anchor_digests, voted_ahead=sync.voted_ahead
    )


@pytest.mark.timeout(120)
def test_a_delayed_round_lands_later_under_the_progress_made_meanwhile(tmp_path: Path) -> None:
    sites = spawn(_delayed_worker, 2, tmp_path, str(tmp_path))
    # Rounds start after steps 2, 5 and 8 (the last); they land after 4 and 7, and the
    # last one at once, so the job ends with equal parameters.
    assert sites[0]["landed"] == [4, 7, 8]
    # The delayed rounds are voted on as they start; the last one lands at once.
    assert sites[0]["voted_ahead"] == sites[1]["voted_ahead"] == [2, 5]
    assert sites[0]["anchors"] == sites[1]["anchors"]  # equal anchors whenever one landed
    assert sites[0]["digest"] == sites[1]["digest"]
    assert max(sites[0]["errors"] + sites[1]["errors"]) < 1e-5


def _groups_flat(trainer: Trainer, indices: list[int]) -> torch.Tensor:
    groups = outer_groups(trainer)
    return torch.cat([t.detach().reshape(-1).clone() for i in indices for _, t in groups[i]])


def _streaming_worker(site: int, tmp: str) -> dict[str, Any]:
    """Streaming DiLoCo, H = 4, P = 2, delay 1, alpha 0.5: fragment 0 (block 0) syncs
    after steps 1, 5, fragment 1 (block 1 and the embedding/norm/head) after 3, 7;
    each lands a step later, mixed half and half with the local parameters; the last
    step syncs both at once. Checked against torch's Nesterov SGD per fragment."""
    trainer, data, cross = _site(site, tmp)
    config = OuterConfig(inner_steps=4, lr=0.7, momentum=0.9, delay=1, fragments=2, alpha=0.5)
    outer = OuterOptimizer(trainer, AveragingSync(cross, 2), config, total_steps=10)
    members = {k: [i for i, f in enumerate(outer.fragment) if f == k] for k in (0, 1)}
    refs = {k: torch.nn.Parameter(_groups_flat(trainer, members[k])) for k in (0, 1)}
    sgds = {k: torch.optim.SGD([refs[k]], lr=0.7, momentum=0.9, nesterov=True) for k in (0, 1)}
    landed, errors, untouched, anchors, started, due = [], [], [], [], None, []
    shared: list[bool] = []
    shared_losses: list[float] = []
    held_out = random_batches(SEQ, BATCH, SEED + 1)
    for step in range(10):
        trainer.step(step, *data.batch(step))
        due.append(outer.due_fragments(step))
        before = {k: _groups_flat(trainer, members[k]) for k in (0, 1)}
        expected: dict[int, torch.Tensor] = {}
        if outer.lands(step):
            k, own = started
            refs[k].grad = _mean_over_sites(own, cross)
            sgds[k].step()
            expected[k] = 0.5 * before[k] + 0.5 * refs[k].detach()
        if step == 9:  # the last round: every fragment, landing at once on the anchor
            for k in (0, 1):
                refs[k].grad = _mean_over_sites(refs[k].detach() - before[k], cross)
                sgds[k].step()
                expected[k] = refs[k].detach().clone()
        elif outer.due(step):
            (k,) = outer.due_fragments(step)
            started = (k, refs[k].detach() - before[k])
        landed_now = outer.step(step)
        # The held-out loss's model: the anchors, swapped in and the local parameters
        # put back bit for bit.
        local = _flat_params(trainer)
        with outer.shared_model():
            shared.append(torch.equal(_flat_params(trainer), torch.cat(outer.anchor)))
            shared_losses.append(trainer.evaluate(*held_out.batch(step)))
        shared.append(torch.equal(_flat_params(trainer), local))
        if landed_now:
            landed.append(step)
            anchors.append(outer.anchor_digest())
            for k in (0, 1):
                now = _groups_flat(trainer, members[k])
                if k in expected:
                    errors.append(float((now - expected[k]).abs().max()))
                else:
                    untouched.append(torch.equal(now, before[k]))
    return _leave(
        trainer, landed=landed, errors=errors, untouched=untouched, anchors=anchors, due=due,
        members=members, outer_steps=outer.outer_steps, shared=shared, shared_losses=shared_losses,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_streaming_fragments_land_in_turn_mixed_with_local_progress(tmp_path: Path) -> None:
    sites = spawn(_streaming_worker, 2, tmp_path, str(tmp_path))
    s0, s1 = sites
    # tiny: groups are block 0, block 1, then the rest; blocks strided over 2 fragments.
    assert s0["members"] == {0: [0], 1: [1, 2]}
    assert s0["due"] == [[], [0], [], [1], [], [0], [], [1], [], [0, 1]]
    assert s0["landed"] == [2, 4, 6, 8, 9] and s0["outer_steps"] == 5
    assert all(s0["untouched"]) and len(s0["untouched"]) == 4  # the other fragment
    assert max(s0["errors"] + s1["errors"]) < 1e-5
    assert s0["anchors"] == s1["anchors"]  # the anchors agree at every landing
    assert s0["digest"] == s1["digest"]  # and the parameters at the end
    # The shared model is the anchors, the same at both sites at every step (the same
    # held-out batch gives the same loss) while their local parameters differ.
    assert all(s0["shared"]) and all(s1["shared"]) and len(s0["shared"]) == 20
    assert s0["shared_losses"] == s1["shared_losses"]


def test_fragments_deal_the_blocks_strided() -> None:
    t = torch.zeros(1)
    assert [fragment_of([(f"layers.{i}.w", t)], 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert fragment_of([("embed.weight", t)], 4) == 3  # with the last fragment


def test_outer_config_refuses_bad_values() -> None:
    for kwargs, needle in (
        ({"inner_steps": 0}, "inner_steps"),
        ({"lr": 0.0}, "lr"),
        ({"lr_ramp": 0.0}, "lr_ramp"),
        ({"momentum": 1.0}, "momentum"),
        ({"inner_steps": 3, "delay": 3}, "delay"),
        ({"delay": -1}, "delay"),
        ({"inner_steps": 6, "fragments": 4}, "fragments must divide"),
        ({"inner_steps": 6, "fragments": 3, "delay": 2}, r"inner_steps/fragments=2"),
        ({"alpha": 1.5}, "alpha"),
    ):
        with pytest.raises(ValueError, match=needle):
            OuterConfig(**kwargs)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.mlp = torch.nn.Linear(4, 4)


class _HfLike(torch.nn.Module):
    """As Hugging Face nests them: ``model.layers`` (Llama), beside an embedding and a
    head, and a short list of norms that is not the blocks."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(10, 4)
        self.model.layers = torch.nn.ModuleList(_Block() for _ in range(blocks))
        self.model.norms = torch.nn.ModuleList(torch.nn.LayerNorm(4) for _ in range(2))
        self.lm_head = torch.nn.Linear(4, 10)


class _Parts:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_parts = [model]


def test_fragments_follow_a_users_blocks_at_any_depth() -> None:
    """Issue 60: Streaming DiLoCo took fragments only from a top-level ``layers``
    ModuleDict, so any Hugging Face model (``model.layers``, ``transformer.h``) or
    ``nn.Sequential`` was one group, silently DiLoCo. The blocks are found where they
    are; the rest goes with the last fragment."""
    from isthmus.intra.outer_groups import repeated_blocks

    hf = _HfLike(blocks=4)
    where, blocks = repeated_blocks(hf)
    assert where == "model.layers" and [k for k, _ in blocks] == ["0", "1", "2", "3"]
    groups = outer_groups(_Parts(hf))  # type: ignore[arg-type]
    assert [g.block for g in groups] == [0, 1, 2, 3, None]
    assert groups[1][0][0] == "model.layers.1.attn.weight"
    rest = {name for name, _ in groups[-1]}
    assert "model.embed_tokens.weight" in rest and "lm_head.weight" in rest
    assert "model.norms.0.weight" in rest  # two LayerNorms hold fewer parameters
    assert [fragment_of(g, 2) for g in groups] == [0, 1, 0, 1, 1]
    # Every parameter in exactly one group.
    named = [name for g in groups for name, _ in g]
    assert sorted(named) == sorted(n for n, _ in hf.named_parameters())
    # An nn.Sequential of blocks is its own list of blocks.
    seq = torch.nn.Sequential(_Block(), _Block(), _Block())
    assert [g.block for g in outer_groups(_Parts(seq))] == [0, 1, 2]  # type: ignore[arg-type]
    # A model without a list of blocks is one group (OuterOptimizer warns past 1 fragment).
    flat = torch.nn.Linear(4, 4)
    assert [g.block for g in outer_groups(_Parts(flat))] == [None]  # type: ignore[arg-type]
