"""Context parallelism: every sequence split over a replica's ``cp`` ranks.

Causal attention does more work late in a sequence than early, so a rank does not take
one contiguous piece: the sequence is cut into ``2 * cp`` equal chunks and rank ``r``
holds chunks ``r`` and ``2*cp - 1 - r`` (one from each end), which gives every rank the
same attention work (the load-balanced layout of Megatron's and torchtitan's CP).

Attention gathers the keys and values of all ``cp`` ranks (an all-gather along the
sequence; the backward sums each rank's key and value gradients back to their owner)
and masks causally by global position. Each rank's loss is the mean over its own
tokens; the ranks hold equal token counts, so FSDP2's average over ``dp × cp`` is the
gradient of the mean over the whole sequence. Everything else -- embedding, norms,
MLP, head -- is per token and runs on the local chunks unchanged.

Gathering K and V whole (instead of passing them round a ring) keeps one collective per
layer and exact softmax arithmetic; it costs ``seq_len / cp`` queries against
``seq_len`` keys of memory per rank, which is the ring's total too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

__all__ = ["ContextShard", "local_positions"]


def local_positions(local_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    """The global positions a cp rank holds when it holds ``local_len`` tokens of every
    sequence: chunks ``rank`` and ``2*size - 1 - rank`` of ``2*size``, in that order."""
    if local_len % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {local_len} tokens")
    chunk = local_len // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last_start = (2 * size - 1 - rank) * chunk
    second = torch.arange(last_start, last_start + chunk, device=device)
    return torch.cat([first, second])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 ([batch, heads, seq, head_dim]) in cp-rank order; the
    backward sums the gathered gradient over the ranks and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int):
        ctx.group, ctx.rank, ctx.local = group, rank, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        own = grad.narrow(2, ctx.rank * ctx.local, ctx.local)
        return own, None, None, None


@dataclass(frozen=True, slots=True)
class ContextShard:
    """One rank's place in its context-parallel group (set on the model's attention
    layers by ``parallel.parallelize``)."""

    group: dist.ProcessGroup
    rank: int
    size: int

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return local_positions(local_len, self.rank, self.size, device)

    def shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a ``[batch, seq]`` batch (its two chunks)."""
        seq = tokens.shape[1]
        if seq % (2 * self.size):
            raise ValueError(
                f"context parallelism over cp={self.size} needs the sequence length "
                f"divisible by {2 * self.size}, got {seq}"
            )
        index = self.positions(seq // self.size, tokens.device)
        return tokens.index_select(1, index)

    # A collective inside a compiled block: torch.compile runs it eagerly between the
    # block's compiled pieces rather than tracing a process group.
    @torch.compiler.disable
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every cp rank's ``[batch, heads, local_seq, head_dim]`` along the sequence."""
        return _GatherSequence.apply(x, self.group, self.rank, self.size)

    def causal_mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """``[local_len, cp * local_len]``: True where this rank's query may attend to
        a gathered key (the key's global position is not after the query's)."""
        return _causal_mask(local_len, self.rank, self.size, device)


@lru_cache(maxsize=8)
def _causal_mask(local_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    # Made once per shape, not once per layer and step.
    queries = local_positions(local_len, rank, size, device)
    keys = torch.cat([local_positions(local_len, r, size, device) for r in range(size)])
    return queries[:, None] >= keys[None, :]
