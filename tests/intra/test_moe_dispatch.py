"""The mixture-of-experts dispatch of intra/moe_dispatch.py on one process: the
device-side path against issue 17's per-expert loop, the capacity, the absence of host
reads, the load statistics. Expert parallelism: tests/intra/test_moe_parallel.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from isthmus.intra.model import build_model
from isthmus.intra.model_config import ModelConfig, preset
from isthmus.intra.moe import MoEFeedForward, set_moe_impl
from isthmus.intra.moe_dispatch import capacity, moe_impl_from_env

# Hidden width 96 (not moe-tiny's 86): torch._grouped_mm wants rows of a multiple of
# 16 bytes, so the CPU grouped kernel can run here too.
CFG = replace(preset("moe-tiny"), ffn_hidden=96, top_k=2)
# Both paths multiply the same rows by the same weights; only the order of the rows,
# the kernel's blocking of its inner sums and the combine's additions may differ.
# Measured (2026-11-29, CPU torch 2.13, 5 seeds, all cases below): bitwise equal, the
# CPU grouped_mm looping over plain matmuls. The bound allows a kernel that blocks its
# sums otherwise: a few fp32 ulps of gradients that reach ~340 (std 0.3 weights).
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _layer(cfg: ModelConfig, impl: str, kernel: str = "auto", seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.impl, layer.experts.kernel = impl, kernel
    return layer


def _run(layer: MoEFeedForward, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * upstream).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad, **grads}


@pytest.mark.parametrize("factor", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("kernel", ["auto", "grouped_mm"])
def test_the_device_path_gives_the_loops_outputs_and_gradients(factor, kernel):
    cfg = replace(CFG, capacity_factor=factor)
    x, upstream = torch.randn(2, 16, cfg.dim), torch.randn(2, 16, cfg.dim)
    new = _run(_layer(cfg, "grouped", kernel), x, upstream)
    old = _run(_layer(cfg, "loop"), x, upstream)
    assert sorted(new) == sorted(old)
    for name in old:
        torch.testing.assert_close(new[name], old[name], **TOL, msg=name)


def _reference_with_capacity(layer: MoEFeedForward, tokens: torch.Tensor, limit: int):
    """The capacity spelled out token by token: each expert keeps its ``limit`` copies
    of highest router probability (ties: the earlier token)."""
    probs = layer.router(tokens).softmax(dim=-1)
    scores, chosen = probs.topk(layer.top_k, dim=-1)
    weights = scores / scores.sum(dim=-1, keepdim=True)
    kept = set()
    for e in range(probs.shape[-1]):
        copies = [(-scores[t, j].item(), t, j) for t in range(len(tokens)) for j in range(2)]
        mine = sorted(c for c in copies if chosen[c[1], c[2]].item() == e)
        kept |= {(t, j) for _, t, j in mine[:limit]}
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    rows = []
    for t, h in enumerate(tokens):
        row = torch.zeros_like(h)
        for j in range(layer.top_k):
            if (t, j) in kept:
                e = chosen[t, j].item()
                row += weights[t, j] * F.linear(F.silu(F.linear(h, w1[e])) * (w3[e] @ h), w2[e])
        rows.append(row)
    return torch.stack(rows), len(kept)


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_capacity_drops_each_experts_lowest_scored_copies(impl):
    cfg = replace(CFG, capacity_factor=0.5)
    layer = _layer(cfg, impl)
    tokens = torch.randn(24, cfg.dim)
    limit = capacity(0.5, 24, 2, cfg.n_experts)
    assert limit == math.ceil(0.5 * 24 * 2 / 4) == 6
    expected, kept = _reference_with_capacity(layer, tokens, limit)
    assert kept < 48  # the check saw drops
    with torch.no_grad():
        out = layer(tokens.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert layer.last_stats is not None
    assert layer.last_stats[2].item() == pytest.approx(1 - kept / 48)


def test_the_grouped_path_reads_nothing_back_to_the_host():
    """Under FakeTensorMode a tensor has no values: any host read of one (``.item()``,
    ``.tolist()``, an op whose output size depends on values) raises. The grouped path's
    forward and backward go through; the loop's forward does not."""
    for factor in (0.0, 1.0):
        torch.set_default_dtype(torch.bfloat16)  # the grouped kernel's meta wants bf16
        try:
            with FakeTensorMode():
                layer = MoEFeedForward(replace(CFG, capacity_factor=factor))
                layer.impl, layer.experts.kernel = "grouped", "grouped_mm"
                x = torch.randn(2, 8, CFG.dim, requires_grad=True)
                layer(x).sum().backward()
                assert layer.experts.w2.grad is not None and x.grad is not None
                layer.impl = "loop"
                with pytest.raises(Exception, match="_local_scalar_dense"):
                    layer(x)
        finally:
            torch.set_default_dtype(torch.float32)


def test_load_statistics_count_the_routing():
    layer = _layer(CFG, "grouped")
    x = torch.randn(2, 8, CFG.dim)
    layer(x)
    chosen = layer.router(x.reshape(-1, CFG.dim)).topk(2, dim=-1).indices
    routed = torch.bincount(chosen.reshape(-1), minlength=4).float()
    assert layer.last_stats is not None and layer.last_aux_loss is not None
    aux, ratio, dropped = layer.last_stats.tolist()
    assert aux == layer.last_aux_loss.item()
    assert ratio == pytest.approx((routed.max() / routed.mean()).item())
    assert dropped == 0.0  # dropless
    with torch.no_grad():
        layer.router.weight.zero_()  # ties: top-k takes the first experts, never the rest
    layer(x)
    assert layer.last_stats[1].item() == pytest.approx(2.0)


def test_the_implementation_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("ISTHMUS_MOE_IMPL", "loop")
    assert MoEFeedForward(CFG).impl == "loop"
    monkeypatch.delenv("ISTHMUS_MOE_IMPL")
    assert moe_impl_from_env() == "grouped"
    monkeypatch.setenv("ISTHMUS_MOE_IMPL", "fast")
    with pytest.raises(ValueError, match=r"^ISTHMUS_MOE_IMPL='fast': choose one of"):
        MoEFeedForward(CFG)
    monkeypatch.delenv("ISTHMUS_MOE_IMPL")
    model = build_model(CFG, 0)
    assert set_moe_impl(model, "loop") == CFG.n_layers
    with pytest.raises(ValueError, match="choose one of"):
        set_moe_impl(model, "fast")
    assert all(m.impl == "loop" for m in model.modules() if isinstance(m, MoEFeedForward))


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True, "1"])
def test_a_bad_capacity_factor_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^ModelConfig.capacity_factor must be a finite") as e:
        replace(CFG, capacity_factor=bad)
    assert "\n" not in str(e.value)


def test_torch_compile_sees_the_grouped_layer_as_one_graph():
    """``parallel.compile`` compiles each block: on the grouped path the MoE layer is one
    graph without a break (its forward and backward compile whole); the loop's host
    read breaks it in two."""
    for impl, graphs in (("grouped", 1), ("loop", 2)):
        layer = MoEFeedForward(replace(CFG, capacity_factor=1.0)).to(torch.bfloat16)
        layer.impl, layer.experts.kernel = impl, "grouped_mm"
        explained = torch._dynamo.explain(layer)(torch.randn(2, 16, CFG.dim, dtype=torch.bfloat16))
        assert explained.graph_count == graphs, explained.break_reasons
