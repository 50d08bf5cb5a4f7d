"""The mixture-of-experts grouped GEMM path on a CUDA GPU in bf16 (intra/moe_dispatch.py):
against the per-expert loop, without a host synchronization, with empty experts and
with dropped copies over a caching allocator full of NaN; and expert parallelism's
static slots (intra/moe_static.py) over NCCL, one rank per GPU, without a host
synchronization. Runs where a GPU is (the GPU host); the same paths on CPU:
tests/intra/test_moe_dispatch.py and tests/intra/test_moe_parallel.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_helpers import spawn
from torch import nn

from isthmus.intra.model_config import preset
from isthmus.intra.moe import MoEFeedForward
from isthmus.intra.moe_dispatch import ExpertShard, grouped_mm_usable

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


def _expert_parallel_layer(impl: str, shard: ExpertShard) -> MoEFeedForward:
    """``_layer``'s layer with a capacity, holding this rank's slice of the experts."""
    layer = _layer(impl, factor=1.0)
    local_n = CFG.n_experts // shard.size
    mine = slice(shard.rank * local_n, (shard.rank + 1) * local_n)
    layer.expert_shard = shard
    for name, param in list(layer.experts.named_parameters()):
        layer.experts.register_parameter(name, nn.Parameter(param.detach()[mine].clone()))
    return layer


def _static_slots_rank(rank: int, world: int, store: str) -> dict:
    """One rank on its own GPU: a forward and backward through static slots under the
    sync debug mode's "error", the host-split path's under it too (it must raise), then
    the latter's numbers without it, to compare."""
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    shard = ExpertShard(dist.group.WORLD, rank, world)
    layers = {impl: _expert_parallel_layer(impl, shard) for impl in ("grouped", "host-splits")}
    inputs = _inputs(seed=10 + rank)
    for layer in layers.values():
        _run(layer, inputs=inputs)  # first use: NCCL's communicator, cuBLAS handles
        layer.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    raised = ""
    try:
        static = _run(layers["grouped"], inputs=inputs)
        try:
            _run(layers["host-splits"], inputs=inputs)
        except RuntimeError as exc:  # every rank raises at the same host read
            raised = str(exc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    layers["host-splits"].zero_grad()
    counted = _run(layers["host-splits"], inputs=inputs)
    dropped = layers["grouped"].last_stats
    dist.barrier()
    dist.destroy_process_group()
    on_host = lambda d: {k: v.float().cpu() for k, v in d.items()}  # noqa: E731
    return {
        "raised": raised,
        "static": on_host(static),
        "counted": on_host(counted),
        "dropped": None if dropped is None else dropped[2].item(),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_expert_parallel_static_slots_never_synchronize(world, tmp_path):
    """ep 2 over two GPUs (ep 1, an exchange with itself, where one GPU is all)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    ranks = spawn(_static_slots_rank, world, tmp_path, world, str(tmp_path / "store"))
    for r in ranks:
        assert "synchroniz" in r["raised"], r["raised"]
        assert r["dropped"] is not None and r["dropped"] > 0
        _close(r["static"], r["counted"])
