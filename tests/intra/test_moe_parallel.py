"""Expert parallelism's token exchange (intra/moe_dispatch.run_expert_parallel, and with
a capacity intra/moe_static.py's static slots) on two gloo ranks, each holding half the
experts, against one process holding all of them: outputs and gradients, dropless and
with a capacity, for the device-side paths and issue 17's loop, and how often each
reads sizes back to the host. The whole trainer under expert parallelism:
tests/intra/test_intra_parallel.py (moe-ep4 and the others)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_helpers import init_gloo, shutdown, spawn
from helpers import load_benchmark
from torch import nn

from isthmus.intra.model_config import preset
from isthmus.intra.moe import MoEFeedForward
from isthmus.intra.moe_dispatch import ExpertShard

CFG = replace(preset("moe-tiny"), n_experts=4, top_k=2)
# Uneven token counts per rank, so the all-to-all splits differ both ways. Static slots
# need one capacity on every rank, so as many tokens: there the splits the routing
# would give differ, and the padding evens them out.
UNEVEN, EVEN = (12, 20), (16, 16)
# 16 tokens: each expert keeps 6 of a rank's copies (of 8 on average), or all 16.
TIGHT, LOOSE = 0.75, 2.0


def _counting_host_reads():
    """benchmarks/moe_step.py's ``host reads`` counter (``Tensor.tolist``, ``.item``)."""
    return load_benchmark("moe_step").counting_host_reads()


def _layer(factor: float, impl: str) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(replace(CFG, capacity_factor=factor))
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    layer.impl = impl
    return layer


def _tokens(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(1, n, CFG.dim, generator=g), torch.randn(1, n, CFG.dim, generator=g)


def _forward_backward(layer: MoEFeedForward, rank: int, n: int) -> dict[str, torch.Tensor]:
    x, upstream = _tokens(rank, n)
    x.requires_grad_()
    out = layer(x)
    (out * upstream).sum().backward()
    return {"out": out.detach(), "x": x.grad}


def _one_case(rank: int, world: int, factor: float, impl: str, tokens: tuple) -> dict:
    # One process's answer for each rank's tokens, and the expert gradient they sum to.
    reference = [_layer(factor, impl) for _ in range(world)]
    expected = [_forward_backward(layer, r, tokens[r]) for r, layer in enumerate(reference)]
    local_n = CFG.n_experts // world
    mine = slice(rank * local_n, (rank + 1) * local_n)
    layer = _layer(factor, impl)
    layer.expert_shard = ExpertShard(dist.group.WORLD, rank, world)
    for name, param in list(layer.experts.named_parameters()):
        layer.experts.register_parameter(name, nn.Parameter(param.detach()[mine].clone()))
    with _counting_host_reads() as reads:
        got = _forward_backward(layer, rank, tokens[rank])
    expert_grads = {
        name: sum(getattr(ref.experts, name).grad for ref in reference)[mine]
        for name in ("w1", "w2", "w3")
    }
    return {
        "got": got | {f"experts.{n}": p.grad for n, p in layer.experts.named_parameters()},
        "want": expected[rank] | {f"experts.{n}": g for n, g in expert_grads.items()},
        "router": (layer.router.weight.grad, reference[rank].router.weight.grad),
        "reads": reads[0],
        "dropped": layer.last_stats[2].item() if layer.last_stats is not None else None,
    }


CASES = [
    (0.0, "grouped", UNEVEN),
    (0.0, "loop", UNEVEN),
    (TIGHT, "host-splits", UNEVEN),
    (TIGHT, "loop", UNEVEN),
    # "grouped" with a capacity: static slots, against the path they replace.
    *((factor, impl, EVEN) for factor in (TIGHT, LOOSE) for impl in ("grouped", "host-splits")),
]


def _worker(rank: int, world: int, store: str) -> dict:
    # Every case in one pair of processes: starting them is most of the cost.
    init_gloo(rank, world, store)
    out = {case: _one_case(rank, world, *case) for case in CASES}
    shutdown()
    return out


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, list[dict]]:
    tmp = tmp_path_factory.mktemp("moe_ep2")
    ranks = spawn(_worker, 2, tmp, 2, str(tmp / "store"), timeout=150)
    return {case: [r[case] for r in ranks] for case in CASES}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("factor", "impl", "tokens"), CASES)
def test_two_expert_ranks_match_one_process(
    two_rank_results, factor: float, impl: str, tokens: tuple
) -> None:
    ranks = two_rank_results[(factor, impl, tokens)]
    for r in ranks:
        # The same sums in another order (a token's expert outputs arrive through two
        # all-to-alls): a few fp32 ulps of values up to ~300 (std 0.3 weights).
        for name, want in r["want"].items():
            torch.testing.assert_close(r["got"][name], want, rtol=1e-5, atol=1e-5, msg=name)
        # The router's gradient is this rank's own (its tokens, its routing).
        torch.testing.assert_close(*r["router"], rtol=1e-5, atol=1e-5)
        assert (r["dropped"] > 0) == (factor == TIGHT), r["dropped"]
    # Host reads in one forward and backward: with a capacity, static slots read none;
    # the other device paths read the split sizes and local counts once, as one
    # tensor; the loop reads sends, receives and counts apart.
    reads = {"grouped": 0 if factor else 1, "host-splits": 1, "loop": 3}[impl]
    assert [r["reads"] for r in ranks] == [reads, reads]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("factor", [TIGHT, LOOSE])
def test_static_slots_give_the_host_split_paths_numbers(two_rank_results, factor: float) -> None:
    """The same routing and capacity through static slots and through the exchange they
    replace. Each output row, and each row of the input's gradient, is a sum over the
    same dims in the same order (the padding only adds exact zeros elsewhere): the same
    bits. An expert weight's gradient sums over the expert's rows, ``size * limit`` of
    them here against the kept ones there, which CPU gemm blocks otherwise: measured
    (CPU torch 2.13) up to 4.8e-7 apart in gradients up to ~120, bounded at 4 to 8 fp32
    ulps of each tensor's largest entry."""
    static = two_rank_results[(factor, "grouped", EVEN)]
    counted = two_rank_results[(factor, "host-splits", EVEN)]
    for s, c in zip(static, counted, strict=True):
        for name in ("out", "x"):
            assert torch.equal(s["got"][name], c["got"][name]), name
        assert torch.equal(s["router"][0], c["router"][0])
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            want = c["got"][name]
            atol = 5e-7 * want.abs().max().item()
            torch.testing.assert_close(s["got"][name], want, rtol=0, atol=atol, msg=name)
