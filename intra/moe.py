"""Mixture of experts: a top-k routed SwiGLU feed-forward, dropless.

A router scores every token against ``n_experts`` experts; each token goes to its
``top_k`` best, weighted by their renormalized softmax scores, and every expert computes
every token sent to it (dropless: no capacity, no token dropped, so the result does not
depend on how the batch is split over ranks). The experts' weights are stacked
``[n_experts, ...]`` parameters, so FSDP2 shards them like any other.

The load-balancing loss is Switch Transformer's (Fedus et al. 2021, eq. 4):
``n_experts * sum_i f_i * P_i``, ``f_i`` the share of routed slots expert ``i`` got and
``P_i`` its mean router probability, 1 when routing is uniform. It is computed on the
rank's own tokens and joins the gradient without changing the reported loss: the
layer's output carries it into backward (Megatron's aux-loss scaler does the same), so
it works inside pipeline stages, where no stage but the last sees the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .model_config import ModelConfig

__all__ = ["ExpertShard", "GroupedExperts", "MoEFeedForward"]


def _exchange(
    rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of ``rows`` (``send_splits[r]`` to rank ``r``) whose backward sends the
    gradients back the same way."""
    out = funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, group)
    return funcol.wait_tensor(out)


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


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """This rank's place among the ranks that split the experts (expert parallelism,
    set by ``parallel.parallelize``): rank ``rank`` of ``size`` holds experts
    ``rank * n / size`` to ``(rank + 1) * n / size - 1``."""

    group: dist.ProcessGroup
    rank: int
    size: int


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

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by this rank's experts, ``counts[e]`` rows for expert ``e``
        (all of them without expert parallelism) -> each row through its expert.

        A forward of its own so that FSDP2 gathers the weights first (its hooks run
        around a module's forward). Every expert runs, even on no rows: then every
        rank's backward reaches every expert weight, and FSDP2 sees the same gradients
        everywhere."""
        w1, w3, w2 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2)
        )
        if self.grad_scale != 1.0:
            w1, w3, w2 = (_ScaleGradient.apply(w, self.grad_scale) for w in (w1, w3, w2))
        outs = [
            F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e])
            for e, h in enumerate(rows.split(counts))
        ]
        return torch.cat(outs)


class MoEFeedForward(nn.Module):
    """``[batch, seq, dim] -> [batch, seq, dim]`` through ``top_k`` of ``n_experts``
    SwiGLU experts of hidden width ``ffn_hidden`` each."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.ffn_hidden
        self.top_k, self.aux_loss_coef = cfg.top_k, cfg.aux_loss_coef
        self.router = nn.Linear(d, e, bias=False)
        self.experts = GroupedExperts(e, d, f)
        self.aux_scale = 1.0
        """The aux loss's weight in one backward: 1, or 1 / micro-batches in a pipeline
        (each micro-batch's loss is divided by their count). Set by the trainer."""
        self.last_aux_loss: torch.Tensor | None = None
        """The load-balancing loss of the last forward (before ``aux_loss_coef``)."""
        self.expert_shard: ExpertShard | None = None
        """With expert parallelism (set by ``parallelize``): where the experts are."""

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[tokens, dim]`` -> each token's ``top_k`` experts, their weights (summing
        to 1) and the load-balancing loss of this routing."""
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        n_experts = probs.shape[-1]
        share = F.one_hot(chosen, n_experts).sum(dim=(0, 1)).float() / chosen.numel()
        aux = n_experts * (share * probs.mean(dim=0)).sum()
        return chosen, weights, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        tokens = x.reshape(-1, d)
        chosen, weights, aux = self.route(tokens)
        # Each token's routed copies, grouped by expert (so, under expert parallelism,
        # by the rank that holds it); the results come back in the same order.
        slots = chosen.reshape(-1)
        order = slots.argsort(stable=True)
        source = order // self.top_k
        copies = tokens.index_select(0, source)
        per_expert = torch.bincount(slots, minlength=self.router.out_features)
        if self.expert_shard is None:
            results = self.experts(copies, per_expert.tolist())
        else:
            results = self._exchanged(copies, per_expert, self.expert_shard)
        scale = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, source, results * scale)
        self.last_aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AddAuxGradient.apply(out, aux, self.aux_loss_coef * self.aux_scale)
        return out.view(b, t, d)

    def _exchanged(
        self, copies: torch.Tensor, per_expert: torch.Tensor, shard: ExpertShard
    ) -> torch.Tensor:
        """Expert parallelism: send each copy to the rank holding its expert
        (all-to-all), run this rank's experts on what arrived, and send the results
        back (all-to-all), in ``copies``' order. Both exchanges carry gradients back."""
        local_n = per_expert.numel() // shard.size
        # How many copies each rank sends each of the receiver's experts.
        arriving = torch.empty_like(per_expert)
        dist.all_to_all_single(arriving, per_expert, group=shard.group)
        send_splits = per_expert.view(shard.size, local_n).sum(dim=1).tolist()
        recv_splits = arriving.view(shard.size, local_n).sum(dim=1).tolist()
        received = _exchange(copies, recv_splits, send_splits, shard.group)
        # Arrivals come grouped by sender, then by this rank's expert: regroup them by
        # expert for the experts, and the results back into arrival order.
        owner = torch.arange(local_n, device=copies.device).repeat(shard.size)
        expert_of_row = owner.repeat_interleave(arriving.to(copies.device))
        by_expert = expert_of_row.argsort(stable=True)
        counts = torch.bincount(expert_of_row, minlength=local_n).tolist()
        y = self.experts(received.index_select(0, by_expert), counts)
        results = torch.zeros_like(received).index_copy(0, by_expert, y)
        return _exchange(results, send_splits, recv_splits, shard.group)
