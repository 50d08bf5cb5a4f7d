"""The mixture-of-experts grouped GEMM path on a CUDA GPU in bf16 (intra/moe_dispatch.py):
against the per-expert loop, without a host synchronization, with empty experts and
with dropped copies over a caching allocator full of NaN. Runs where a GPU is (the GPU
host); the same paths on CPU: tests/intra/test_moe_dispatch.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from isthmus.intra.model_config import preset
from isthmus.intra.moe import MoEFeedForward
from isthmus.intra.moe_dispatch import grouped_mm_usable

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# moe-125m's shape, fewer tokens: dims multiples of 8, as the grouped kernel wants.
CFG = replace(preset("moe-125m"), n_layers=1)


def _layer(impl: str, factor: float = 0.0) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(replace(CFG, capacity_factor=factor))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer.impl = impl
    return layer.cuda().to(torch.bfloat16)


def _inputs(seed: int = 1, positive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input and the gradient that reaches its output (made apart from the
    run: seeding a CUDA generator copies to the device and waits)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(4, 256, CFG.dim, device="cuda", dtype=torch.bfloat16, generator=g)
    x = x.abs() if positive else x
    return x, torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g)


def _run(layer: MoEFeedForward, seed: int = 1, positive: bool = False, inputs=None):
    x, upstream = inputs if inputs is not None else _inputs(seed, positive)
    x = x.detach().requires_grad_()
    out = layer(x)
    (out.float() * upstream.float()).sum().backward()
    return {"out": out.detach(), "x": x.grad} | {n: p.grad for n, p in layer.named_parameters()}


def _close(got: dict, want: dict) -> None:
    # Different kernels in bf16 (8-bit mantissa, ulp 0.4 %): each matmul's output is
    # rounded to bf16, so the two differ by a few ulps of each tensor's largest entries.
    for name, w in want.items():
        scale = w.float().abs().max().item()
        torch.testing.assert_close(
            got[name].float(), w.float(), rtol=2e-2, atol=2e-2 * scale, msg=name
        )


def test_the_grouped_kernel_is_chosen_for_bf16_and_not_fp32():
    rows = torch.zeros(8, CFG.dim, device="cuda", dtype=torch.bfloat16)
    weight = torch.zeros(8, CFG.dim, CFG.ffn_hidden, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_usable(rows, weight)
    assert not grouped_mm_usable(rows.float(), weight.float())
    assert not grouped_mm_usable(rows.cpu(), weight.cpu())


@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_grouped_gemm_gives_the_loops_outputs_and_gradients(factor):
    _close(_run(_layer("grouped", factor)), _run(_layer("loop", factor)))


@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_the_grouped_path_never_synchronizes_with_the_host(factor):
    layer, loop = _layer("grouped", factor), _layer("loop", factor)
    _run(layer)  # first use: lazy CUDA initialization, cuBLAS handles
    inputs = _inputs(seed=2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(layer, inputs=inputs)
        with pytest.raises(RuntimeError, match="synchroniz"):
            _run(loop, inputs=inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_experts_without_tokens_get_zero_gradients():
    layer = _layer("grouped")
    with torch.no_grad():
        # Positive tokens score experts 0-3 above 4-7: those never reach a top 2.
        layer.router.weight[4:].fill_(-0.01)
        layer.router.weight[:4].normal_(0.01, 0.002)
    grads = _run(layer, positive=True)
    for name in ("experts.w1", "experts.w2", "experts.w3"):
        assert grads[name][4:].abs().max().item() == 0.0, name
        assert grads[name][:4].abs().max().item() > 0.0, name


def test_dropped_copies_never_read_the_allocators_leftovers():
    """torch._grouped_mm leaves rows past its last offset unwritten, in the output and
    in the input's gradient (pytorch#154557): fill the caching allocator's blocks with
    NaN first, then train with a capacity that drops copies."""
    layer, loop = _layer("grouped", 0.5), _layer("loop", 0.5)
    want = _run(loop)
    for _ in range(3):
        poison = torch.full((64 * 2**20,), float("nan"), device="cuda", dtype=torch.bfloat16)
        del poison
        layer.zero_grad()
        got = _run(layer)
        assert all(torch.isfinite(t).all() for t in got.values())
        _close(got, want)
