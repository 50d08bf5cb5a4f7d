"""The mixture-of-experts feed-forward (intra/moe.py): dispatch, combine, the
load-balancing loss and its gradient, on one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from isthmus.intra.model import FeedForward, build_model
from isthmus.intra.model_config import ModelConfig, preset
from isthmus.intra.moe import MoEFeedForward

CFG = replace(preset("moe-tiny"), n_experts=4, top_k=2)


def _layer(cfg: ModelConfig = CFG, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer


def test_experts_with_equal_weights_give_the_dense_mlp():
    """Routed weights sum to 1, so k copies of one MLP give that MLP's output."""
    layer = _layer()
    dense = FeedForward(replace(CFG, n_experts=0))
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            stacked = getattr(layer.experts, name)
            getattr(dense, name).weight.copy_(stacked[0])
            stacked.copy_(stacked[0].expand_as(stacked))
    x = torch.randn(2, 8, CFG.dim)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-6)


def test_top_1_sends_each_token_to_its_best_expert_alone():
    layer = _layer(replace(CFG, top_k=1))
    x = torch.randn(3, 5, CFG.dim)
    tokens = x.reshape(-1, CFG.dim)
    best = layer.router(tokens).argmax(dim=-1)
    expected = torch.stack(
        [
            F.linear(
                F.silu(F.linear(t, layer.experts.w1[e])) * F.linear(t, layer.experts.w3[e]),
                layer.experts.w2[e],
            )
            for t, e in zip(tokens, best.tolist(), strict=True)
        ]
    )
    torch.testing.assert_close(layer(x).reshape(-1, CFG.dim), expected, rtol=1e-5, atol=1e-6)
    assert len(set(best.tolist())) > 1  # the check saw more than one expert


def test_uniform_routing_has_load_balancing_loss_one():
    layer = _layer()
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(torch.randn(2, 8, CFG.dim))
    assert layer.last_aux_loss is not None
    assert layer.last_aux_loss.item() == pytest.approx(1.0, rel=1e-6)


def test_the_load_balancing_loss_joins_the_gradient_and_not_the_output():
    """Backward through a layer with aux_loss_coef c equals backward through the same
    layer without it plus c times the routing's loss: the output is untouched."""
    coef = 0.5
    with_aux = _layer(replace(CFG, aux_loss_coef=coef), seed=3)
    without = _layer(replace(CFG, aux_loss_coef=0.0), seed=3)
    x = torch.randn(2, 8, CFG.dim)
    upstream = torch.randn(2, 8, CFG.dim)
    out = with_aux(x)
    (out * upstream).sum().backward()
    out0 = without(x)
    aux = without.route(x.reshape(-1, CFG.dim)).aux
    ((out0 * upstream).sum() + coef * aux).backward()
    assert torch.equal(out, out0)
    for (name, a), b in zip(with_aux.named_parameters(), without.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=name)
    # ... and the aux loss moved the router by far more than that tolerance.
    plain = _layer(replace(CFG, aux_loss_coef=0.0), seed=3)
    (plain(x) * upstream).sum().backward()
    assert (with_aux.router.weight.grad - plain.router.weight.grad).abs().max() > 1e-3


def test_moe_presets_count_their_active_parameters_like_the_dense_ones():
    model = build_model(preset("moe-tiny"), 0)
    assert model.num_params() == preset("moe-tiny").num_params
    for name in ("tiny", "small", "125m", "350m"):
        moe, dense = preset(f"moe-{name}"), preset(name)
        routers = moe.n_layers * moe.n_experts * moe.dim
        assert moe.num_params - moe.inactive_params - routers == dense.num_params


def test_a_bad_expert_setting_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"top_k=5 must be in 1..n_experts=4"):
        replace(CFG, top_k=5)
