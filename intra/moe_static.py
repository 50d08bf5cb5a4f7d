"""Expert parallelism with a capacity and no host read: every expert gets static slots.

Dropless, the all-to-all that sends each kept copy to its expert's rank needs its split
sizes on the host, and reading them waits for the device once a layer (~80 ms of a
212 ms step at ep 2 on 2x H200, docs/benchmarks/one-site.md). With ``capacity_factor`` > 0 an
expert keeps at most ``limit`` of a rank's copies (intra/moe_dispatch.capacity), a
number known from shapes. So each rank sends every expert exactly ``limit`` rows: its
kept copies, best first, then zero rows. Every rank then sends each peer, and receives
from each, ``local_n * limit`` rows, known everywhere without asking. The arrivals come
sender-major, then expert, then slot; a transpose makes them expert-major, and the
experts run on ``size * limit`` rows each, at offsets fixed by the shapes.

The padded rows are zero on the way in and masked on the way out, as the dropped copies
are: they add nothing, but cost ``n_experts * limit`` rows where the dropless path moves
``tokens * top_k``. Every rank of the expert group must route as many tokens (the
trainer's batches have one shape), so that all share one ``limit``: else the exchange
fails or hangs.
"""

from __future__ import annotations

import torch

from .moe_dispatch import ExpertShard, RunExperts, exchange_rows

__all__ = ["run_expert_parallel_static", "slot_sources"]


def slot_sources(
    counts: torch.Tensor, limit: int, n_copies: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``n_experts * limit`` slots (expert-major) takes its copy from,
    given the kept copies per expert (``counts``, each at most ``limit``, lying together in
    expert order as ``plan_dispatch`` orders them) of ``n_copies`` kept and dropped.
    Returns each slot's copy index, and ``[slots, 1]``: which slots hold a copy (an empty
    slot's index is another copy's, or the last: its row is masked)."""
    place = torch.arange(limit, device=counts.device)
    filled = place < counts.unsqueeze(1)
    starts = counts.cumsum(0) - counts
    index = (starts.unsqueeze(1) + place).clamp(max=n_copies - 1)
    return index.view(-1), filled.view(-1, 1)


def run_expert_parallel_static(
    copies: torch.Tensor, counts: torch.Tensor, limit: int, shard: ExpertShard, run: RunExperts
) -> torch.Tensor:
    """``run_expert_parallel`` for a capacity (``limit``, the same on every rank of
    ``shard``), each expert's rows padded to ``limit`` per sender, so that both
    all-to-alls have equal splits and nothing is read back. ``counts`` (int64, on the
    device) are the kept copies per expert; ``copies`` and the result are as there."""
    size, dim = shard.size, copies.shape[1]
    local_n = counts.numel() // size
    index, filled = slot_sources(counts, limit, copies.shape[0])
    empty = ~filled
    # Rank r's experts own slots r * local_n * limit onwards: equal splits.
    send = copies.index_select(0, index).masked_fill(empty, 0.0)
    splits = [local_n * limit] * size
    received = exchange_rows(send, splits, splits, shard.group)
    # [sender, expert, slot] -> [expert, sender, slot]: each expert's rows together.
    rows = received.view(size, local_n, limit, dim).transpose(0, 1).reshape(-1, dim)
    per_expert = size * limit
    ends = torch.arange(1, local_n + 1, device=copies.device, dtype=torch.int32) * per_expert
    y = run(rows, ends, [per_expert] * local_n)
    results = y.view(local_n, size, limit, dim).transpose(0, 1).reshape(-1, dim)
    back = exchange_rows(results, splits, splits, shard.group).masked_fill(empty, 0.0)
    # Back to the copies' order; an empty slot adds its masked zero to the copy its
    # index names, which leaves that copy's value as it is.
    return torch.zeros_like(copies).index_add(0, index, back)
