"""Context parallelism: every sequence split over a replica's ``cp`` ranks, two chunks
each, one from each end, and keys and values all-gathered (docs/one-site.md, "Context
parallelism", says the layout and why).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

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
        """Every cp rank's ``[batch, heads, local_seq, head_dim]`` along the sequence,
        in global order (chunk 0, 1, ..., 2*cp - 1)."""
        gathered = _GatherSequence.apply(x, self.group, self.rank, self.size)
        return gathered.index_select(2, _global_order(x.shape[2], self.size, x.device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over every cp rank's keys: each of its
        two chunks (global chunk ``c``) attends to the keys of chunks ``0..c``, aligned to
        the end (``causal_lower_right``, which flash and memory-efficient kernels take
        without a mask in memory); the two chunks' work is ``2*cp + 1`` blocks on every rank.
        """
        keys, values = self.gather(k), self.gather(v)
        # Grouped-query attention: gather the n_kv_heads, let the kernel share them.
        gqa = k.shape[1] != q.shape[1]
        chunk = q.shape[2] // 2
        outs = []
        for half, c in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            seen = (c + 1) * chunk
            outs.append(
                F.scaled_dot_product_attention(
                    q.narrow(2, half * chunk, chunk),
                    keys.narrow(2, 0, seen),
                    values.narrow(2, 0, seen),
                    attn_mask=causal_lower_right(chunk, seen),
                    enable_gqa=gqa,
                )
            )
        return torch.cat(outs, dim=2)


@lru_cache(maxsize=8)
def _global_order(local_len: int, size: int, device: torch.device) -> torch.Tensor:
    """Indices that put the all-gathered sequence (rank 0's two chunks, rank 1's, ...)
    in global order."""
    gathered = torch.cat([local_positions(local_len, r, size, device) for r in range(size)])
    return gathered.argsort()
