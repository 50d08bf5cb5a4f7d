"""Mixture of experts: a top-k routed SwiGLU feed-forward, dropless by default
(docs/one-site.md, "Mixture of experts and expert parallelism").

Each token goes to its ``top_k`` best experts, weighted by their renormalized softmax
scores. The load-balancing loss is Switch Transformer's (Fedus et al. 2021, eq. 4),
``n_experts * sum_i f_i * P_i``; the layer's output carries it into backward (as
Megatron's aux-loss scaler does), so it works inside pipeline stages, where no stage but
the last sees the loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .model_config import ModelConfig
from .moe_dispatch import (
    MOE_IMPLS,
    ExpertShard,
    capacity,
    exchange_rows,
    expert_counts,
    grouped_mm_usable,
    moe_impl_from_env,
    plan_dispatch,
    run_expert_parallel,
    swiglu_grouped,
    swiglu_loop,
)
from .moe_static import run_expert_parallel_static

__all__ = ["ExpertShard", "GroupedExperts", "MoEFeedForward", "Routing", "set_moe_impl"]


class _AddAuxGradient(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` gets the gradient ``scale``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _ScaleGradient(torch.autograd.Function):
    """Identity; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU MLPs as stacked weights ``[experts, ...]`` (one FSDP2 group
    of their own under expert parallelism, where each rank holds a slice)."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        self.grad_scale = 1.0
        """Multiplies the weights' gradients: ``1 / ep`` under expert parallelism, where an
        expert's gradient sums the ep ranks that sent it tokens (each a mean over its own
        tokens) while FSDP2 averages only over the ranks that share the expert."""
        # auto: torch._grouped_mm where grouped_mm_usable says so, else one expert after
        # another; grouped_mm forces it (tests, on CPU); loop never.
        self.kernel = "auto"

    def forward(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor | None = None,
        counts: list[int] | None = None,
    ) -> torch.Tensor:
        """``rows`` grouped by this rank's experts (device ``offsets``, int32 ends, or host
        ``counts``) -> each row through its expert; rows past the last group give zeros
        (the loop) or are left unwritten (grouped_mm). A forward of its own, so that FSDP2
        gathers the weights first. Every expert runs, even on no rows, so every rank's
        backward reaches every expert weight and FSDP2 sees the same gradients everywhere."""
        w1, w3, w2 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)
        )
        if self.grad_scale != 1.0:
            w1, w3, w2 = (_ScaleGradient.apply(w, self.grad_scale) for w in (w1, w3, w2))
        grouped = self.kernel == "grouped_mm" or (
            self.kernel == "auto" and grouped_mm_usable(rows, w2)
        )
        # No rows at all (an expert-parallel rank nobody sent to): the loop, which
        # still gives every weight its zero gradient.
        if grouped and offsets is not None and rows.shape[0]:
            return swiglu_grouped(rows, offsets, w1, w3, w2)
        if counts is None:
            assert offsets is not None
            # The fallback's one host read (a CPU tensor here costs nothing).
            counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
        return swiglu_loop(rows, counts, w1, w3, w2)


class Routing(NamedTuple):
    """One forward's routing of ``[tokens, dim]``."""

    chosen: torch.Tensor  # [tokens, top_k] expert ids, best first
    weights: torch.Tensor  # [tokens, top_k], summing to 1 per token (the tokens' dtype)
    scores: torch.Tensor  # [tokens, top_k] router probabilities (fp32)
    routed: torch.Tensor  # copies routed to each expert, before any capacity (int64)
    aux: torch.Tensor  # the load-balancing loss of this routing


class MoEFeedForward(nn.Module):
    """``[batch, seq, dim] -> [batch, seq, dim]`` through ``top_k`` of ``n_experts``
    SwiGLU experts of hidden width ``ffn_hidden`` each."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.ffn_hidden
        self.top_k, self.aux_loss_coef = cfg.top_k, cfg.aux_loss_coef
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(d, e, bias=False)
        self.experts = GroupedExperts(e, d, f)
        self.impl = moe_impl_from_env()  # MOE_IMPLS; set_moe_impl changes a model's
        # The aux loss's weight in one backward: 1 / micro-batches (the trainer sets it).
        self.aux_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None  # the last's, before aux_loss_coef
        self.last_stats: torch.Tensor | None = None
        """The last forward's load, on the device (no host read): the load-balancing
        loss, the busiest expert's routed copies over the mean, the share of copies
        dropped (0 when dropless); over this rank's tokens."""
        self.expert_shard: ExpertShard | None = None  # expert parallelism: parallelize sets

    def route(self, tokens: torch.Tensor) -> Routing:
        """``[tokens, dim]`` -> each token's ``top_k`` experts, their weights and the
        load-balancing loss of this routing."""
        probs = self.router(tokens).float().softmax(dim=-1)
        scores, chosen = probs.topk(self.top_k, dim=-1)
        weights = (scores / scores.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        n_experts = probs.shape[-1]
        routed = expert_counts(chosen.reshape(-1), n_experts)
        share = routed.float() / chosen.numel()
        aux = n_experts * (share * probs.mean(dim=0)).sum()
        return Routing(chosen, weights, scores, routed, aux)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        tokens = x.reshape(-1, d)
        routing = self.route(tokens)
        limit = capacity(self.capacity_factor, tokens.shape[0], self.top_k, routing.routed.numel())
        # Each token's routed copies, grouped by expert (so, under expert parallelism,
        # by the rank that holds it); the results come back in the same order.
        plan = plan_dispatch(routing.chosen, routing.scores, routing.routed, limit)
        copies = tokens.index_select(0, plan.source)
        dropped = None if plan.keep is None else ~plan.keep.unsqueeze(-1)
        if dropped is not None:
            copies = copies.masked_fill(dropped, 0.0)
        if self.expert_shard is not None and self.impl == "loop":
            results = self._exchanged_loop(copies, plan.counts, self.expert_shard)
        elif self.expert_shard is not None:
            run = lambda rows, offsets, counts: self.experts(rows, offsets, counts)  # noqa: E731
            if limit is not None and self.impl == "grouped":
                # A capacity fixes every split: static slots, no host read.
                results = run_expert_parallel_static(
                    copies, plan.counts, limit, self.expert_shard, run
                )
            else:
                results = run_expert_parallel(copies, plan.counts, self.expert_shard, run)
        elif self.impl == "loop":
            results = self.experts(copies, counts=plan.counts.tolist())
        else:
            results = self.experts(copies, plan.counts.cumsum(0, dtype=torch.int32))
        if dropped is not None:
            results = results.masked_fill(dropped, 0.0)
        scale = routing.weights.reshape(-1).index_select(0, plan.order).unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, plan.source, results * scale)
        self._record(routing, plan.counts, dropless=plan.keep is None)
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AddAuxGradient.apply(out, routing.aux, self.aux_loss_coef * self.aux_scale)
        return out.view(b, t, d)

    def _record(self, routing: Routing, kept: torch.Tensor, dropless: bool) -> None:
        aux = routing.aux.detach()
        routed = routing.routed.float()
        # new_zeros, not torch.tensor(0.0, device=...): a host-to-device copy waits.
        dropped = aux.new_zeros(()) if dropless else 1.0 - kept.sum().float() / routed.sum()
        self.last_aux_loss = aux
        self.last_stats = torch.stack([aux, routed.max() / routed.mean(), dropped])

    def _exchanged_loop(
        self, copies: torch.Tensor, per_expert: torch.Tensor, shard: ExpertShard
    ) -> torch.Tensor:
        """``run_expert_parallel`` as issue 17 wrote it (``impl = "loop"``): the split
        sizes, the arrivals' layout and the per-expert counts each read to the host."""
        local_n = per_expert.numel() // shard.size
        arriving = torch.empty_like(per_expert)
        dist.all_to_all_single(arriving, per_expert, group=shard.group)
        send_splits = per_expert.view(shard.size, local_n).sum(dim=1).tolist()
        recv_splits = arriving.view(shard.size, local_n).sum(dim=1).tolist()
        sent = sum(send_splits)
        received = exchange_rows(copies[:sent], recv_splits, send_splits, shard.group)
        owner = torch.arange(local_n, device=copies.device).repeat(shard.size)
        expert_of_row = owner.repeat_interleave(arriving.to(copies.device))
        by_expert = expert_of_row.argsort(stable=True)
        counts = torch.bincount(expert_of_row, minlength=local_n).tolist()
        y = self.experts(received.index_select(0, by_expert), counts=counts)
        results = torch.zeros_like(received).index_copy(0, by_expert, y)
        back = exchange_rows(results, send_splits, recv_splits, shard.group)
        dropped = copies.shape[0] - sent
        return torch.cat([back, back.new_zeros(dropped, back.shape[1])]) if dropped else back


def set_moe_impl(model: nn.Module, impl: str) -> int:
    """Switch every mixture-of-experts layer of ``model`` to ``impl`` (``MOE_IMPLS``,
    else ValueError); returns how many layers there were."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"MoE implementation {impl!r}: choose one of {list(MOE_IMPLS)}")
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    for layer in layers:
        layer.impl = impl
    return len(layers)
