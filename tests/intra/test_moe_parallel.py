"""Expert parallelism's token exchange (intra/moe_dispatch.run_expert_parallel) on two
gloo ranks, each holding half the experts, against one process holding all of them:
outputs and gradients, dropless and with a capacity, for the device-side path and issue
17's loop, and how often each reads sizes back to the host. The whole trainer under
expert parallelism: tests/intra/test_intra_parallel.py (moe-ep4 and the others)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_helpers import init_gloo, shutdown, spawn
from torch import nn

from isthmus.intra.model_config import preset
from isthmus.intra.moe import MoEFeedForward
from isthmus.intra.moe_dispatch import ExpertShard

CFG = replace(preset("moe-tiny"), n_experts=4, top_k=2)
# Uneven token counts per rank, so the all-to-all splits differ both ways.
TOKENS = (12, 20)


def _layer(factor: float, impl: str) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(replace(CFG, capacity_factor=factor))
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    layer.impl = impl
    return layer


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return (
        torch.randn(1, TOKENS[rank], CFG.dim, generator=g),
        torch.randn(1, TOKENS[rank], CFG.dim, generator=g),
    )


def _forward_backward(layer: MoEFeedForward, rank: int) -> dict[str, torch.Tensor]:
    x, upstream = _tokens(rank)
    x.requires_grad_()
    out = layer(x)
    (out * upstream).sum().backward()
    return {"out": out.detach(), "x": x.grad}


def _one_case(rank: int, world: int, factor: float, impl: str) -> dict:
    # One process's answer for each rank's tokens, and the expert gradient they sum to.
    reference = [_layer(factor, impl) for _ in range(world)]
    expected = [_forward_backward(layer, r) for r, layer in enumerate(reference)]
    local_n = CFG.n_experts // world
    mine = slice(rank * local_n, (rank + 1) * local_n)
    layer = _layer(factor, impl)
    layer.expert_shard = ExpertShard(dist.group.WORLD, rank, world)
    for name, param in list(layer.experts.named_parameters()):
        layer.experts.register_parameter(name, nn.Parameter(param.detach()[mine].clone()))
    reads = 0
    tolist = torch.Tensor.tolist

    def counting(self: torch.Tensor):
        nonlocal reads
        reads += 1
        return tolist(self)

    torch.Tensor.tolist = counting  # type: ignore[method-assign]
    try:
        got = _forward_backward(layer, rank)
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    expert_grads = {
        name: sum(getattr(ref.experts, name).grad for ref in reference)[mine]
        for name in ("w1", "w2", "w3")
    }
    result = {
        "got": got | {f"experts.{n}": p.grad for n, p in layer.experts.named_parameters()},
        "want": expected[rank] | {f"experts.{n}": g for n, g in expert_grads.items()},
        "router": (layer.router.weight.grad, reference[rank].router.weight.grad),
        "reads": reads,
        "dropped": layer.last_stats[2].item() if layer.last_stats is not None else None,
    }
    return result


CASES = [(factor, impl) for factor in (0.0, 0.75) for impl in ("grouped", "loop")]


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
@pytest.mark.parametrize(("factor", "impl"), CASES)
def test_two_expert_ranks_match_one_process(two_rank_results, factor: float, impl: str) -> None:
    ranks = two_rank_results[(factor, impl)]
    for r in ranks:
        # The same sums in another order (a token's expert outputs arrive through two
        # all-to-alls): a few fp32 ulps of values up to ~300 (std 0.3 weights).
        for name, want in r["want"].items():
            torch.testing.assert_close(r["got"][name], want, rtol=1e-5, atol=1e-5, msg=name)
        # The router's gradient is this rank's own (its tokens, its routing).
        torch.testing.assert_close(*r["router"], rtol=1e-5, atol=1e-5)
        assert (r["dropped"] > 0) == (factor > 0), r["dropped"]
    # Host reads in one forward and backward: the device path reads the split sizes and
    # local counts once, as one tensor; the loop reads sends, receives and counts apart.
    assert [r["reads"] for r in ranks] == ([1, 1] if impl == "grouped" else [3, 3])
