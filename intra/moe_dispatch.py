"""How a mixture-of-experts layer (intra/moe.py) moves tokens to its experts and back.

Everything here runs on the tokens' device (docs/one-site.md says how). Counts come
from ``scatter_add``: ``bincount`` on CUDA reads its maximum back to the host. Under
expert parallelism ``all_to_all_single`` needs its split sizes on the host: one
``.tolist()`` per layer, unless a capacity is set (intra/moe_static.py).

``torch._grouped_mm`` leaves the rows past its last offset unwritten (pytorch#154557),
in the output and in the input's gradient; with a capacity the dropped copies sit
there, so both are masked (``masked_fill`` replaces, where ``0 * NaN`` would not).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

__all__ = [
    "MOE_IMPLS",
    "Dispatch",
    "ExpertShard",
    "capacity",
    "exchange_rows",
    "expert_counts",
    "grouped_mm_usable",
    "moe_impl_from_env",
    "plan_dispatch",
    "run_expert_parallel",
    "swiglu_grouped",
    "swiglu_loop",
]

MOE_IMPLS = ("grouped", "host-splits", "loop")
"""``grouped``: the device-side dispatch above (the default); under expert parallelism
with a capacity, intra/moe_static.py's static slots. Kept to measure against:
``host-splits``, ``grouped`` with the split sizes read to the host as dropless (the path
before static slots); ``loop``, issue 17's: counts read to the host in every layer and
the experts one after another."""

IMPL_ENV = "ISTHMUS_MOE_IMPL"


def moe_impl_from_env() -> str:
    """``ISTHMUS_MOE_IMPL`` (``grouped`` when unset; ValueError if not in MOE_IMPLS)."""
    impl = os.environ.get(IMPL_ENV, "") or "grouped"
    if impl not in MOE_IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r}: choose one of {list(MOE_IMPLS)}")
    return impl


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """This rank's place among the ranks that split the experts (expert parallelism,
    set by ``parallel.parallelize``): rank ``rank`` of ``size`` holds experts
    ``rank * n / size`` to ``(rank + 1) * n / size - 1``."""

    group: dist.ProcessGroup
    rank: int
    size: int


def expert_counts(slots: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many of ``slots`` (expert ids) name each expert, int64 on their device,
    without a host read."""
    ones = torch.ones_like(slots)
    return slots.new_zeros(n_experts).scatter_add_(0, slots, ones)


def capacity(factor: float, tokens: int, top_k: int, n_experts: int) -> int | None:
    """Routed copies each expert takes: ``ceil(factor * tokens * top_k / n_experts)``
    (at least 1), or None for ``factor`` 0 (dropless). From shapes only: no host read."""
    if not factor:
        return None
    return max(1, math.ceil(factor * tokens * top_k / n_experts))


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where a layer's ``tokens * top_k`` routed copies go, all on the device."""

    order: torch.Tensor
    """Copy indices (``token * top_k + j``) in expert order: each expert's kept copies
    together, expert 0 first; the dropped ones after all of them."""
    source: torch.Tensor  # the token each copy in order comes from
    counts: torch.Tensor  # kept copies per expert (int64)
    keep: torch.Tensor | None  # in order: which copies are kept; None when dropless


def plan_dispatch(
    chosen: torch.Tensor, scores: torch.Tensor, routed: torch.Tensor, limit: int | None
) -> Dispatch:
    """Sort the routed copies (``[tokens, top_k]`` expert ids ``chosen``, their router
    ``scores``, ``routed`` their ``expert_counts``) by expert and apply the capacity: beyond
    ``limit`` (None: all kept) an expert drops the copies of lowest router probability
    first; equal ones keep the earlier token."""
    top_k = chosen.shape[-1]
    slots = chosen.reshape(-1)
    if limit is None:
        order = slots.argsort(stable=True)
        return Dispatch(order, order // top_k, routed, None)
    n_experts = routed.numel()
    # Best score first (stable: ties in token order), then grouped by expert (stable:
    # each expert's copies stay best first).
    by_score = scores.reshape(-1).argsort(descending=True, stable=True)
    ranked = by_score.index_select(0, slots.index_select(0, by_score).argsort(stable=True))
    expert = slots.index_select(0, ranked)
    starts = routed.cumsum(0) - routed
    place = torch.arange(slots.numel(), device=slots.device) - starts.index_select(0, expert)
    kept = place < limit
    # The dropped copies move behind every kept one (expert id n_experts sorts last).
    last = torch.where(kept, expert, n_experts).argsort(stable=True)
    order = ranked.index_select(0, last)
    return Dispatch(order, order // top_k, routed.clamp(max=limit), kept.index_select(0, last))


def grouped_mm_usable(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts here: bf16 on a CUDA device of
    compute capability 8.0 or above (what torch's grouped GEMM supports), rows and
    weights rows whose strides are multiples of 16 bytes (it refuses others)."""
    if not hasattr(torch, "_grouped_mm") or rows.device.type != "cuda":
        return False
    if rows.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(rows.device) < (8, 0):
        return False
    return all(n % 8 == 0 for n in weight.shape[1:])


def swiglu_grouped(
    rows: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Each expert's SwiGLU MLP on its rows (expert ``e``: rows ``offsets[e-1]`` to
    ``offsets[e]``), as three grouped matmuls; rows past ``offsets[-1]`` unwritten."""
    gate = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


def swiglu_loop(
    rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``swiglu_grouped`` one expert after another (``counts[e]`` rows each), rows past
    them zero. Every expert runs, even on no rows, so every weight gets a gradient."""
    rest = rows.shape[0] - sum(counts)
    parts = rows.split([*counts, rest])
    outs = [
        F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e])
        for e, h in enumerate(parts[:-1])
    ]
    return torch.cat([*outs, rows.new_zeros(rest, w2.shape[1])])


def exchange_rows(
    rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of ``rows`` (``send_splits[r]`` to rank ``r``) whose backward sends the
    gradients back the same way."""
    out = funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, group)
    return funcol.wait_tensor(out)


RunExperts = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
"""``(rows in local-expert order, their device offsets, their host counts) -> outputs``."""


def run_expert_parallel(
    copies: torch.Tensor, counts: torch.Tensor, shard: ExpertShard, run: RunExperts
) -> torch.Tensor:
    """Send each kept copy to the rank holding its expert (all-to-all), run this rank's
    experts on what arrived, send the results back (all-to-all), in ``copies``' order;
    the dropped copies (at the end of ``copies``) come back zero. Both exchanges carry
    gradients back. One host read: the split sizes and local counts, together."""
    size = shard.size
    local_n = counts.numel() // size
    # How many copies each rank sends each of the receiver's experts.
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts, group=shard.group)
    arriving = arriving.to(copies.device)
    grid = arriving.view(size, local_n)
    sizes = torch.cat([counts.view(size, local_n).sum(1).to(grid.device), grid.sum(1), grid.sum(0)])
    host = sizes.tolist()  # all_to_all_single takes its splits as lists
    send_splits, recv_splits, local_counts = host[:size], host[size : 2 * size], host[2 * size :]
    sent, received_n = sum(send_splits), sum(recv_splits)
    received = exchange_rows(copies[:sent], recv_splits, send_splits, shard.group)
    # Arrivals come grouped by sender, then by this rank's expert: regroup them by
    # expert for the experts, and the results back into arrival order.
    owner = torch.arange(local_n, device=copies.device).repeat(size)
    expert_of_row = owner.repeat_interleave(arriving, output_size=received_n)
    by_expert = expert_of_row.argsort(stable=True)
    offsets = grid.sum(0).cumsum(0, dtype=torch.int32)
    y = run(received.index_select(0, by_expert), offsets, local_counts)
    results = torch.zeros_like(received).index_copy(0, by_expert, y)
    back = exchange_rows(results, send_splits, recv_splits, shard.group)
    dropped = copies.shape[0] - sent
    return torch.cat([back, back.new_zeros(dropped, back.shape[1])]) if dropped else back
