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

import torch
import torch.nn.functional as F
from torch import nn

from .model_config import ModelConfig

__all__ = ["MoEFeedForward"]


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


class MoEFeedForward(nn.Module):
    """``[batch, seq, dim] -> [batch, seq, dim]`` through ``top_k`` of ``n_experts``
    SwiGLU experts of hidden width ``ffn_hidden`` each."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.ffn_hidden
        self.top_k, self.aux_loss_coef = cfg.top_k, cfg.aux_loss_coef
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, d))  # gate
        self.w3 = nn.Parameter(torch.empty(e, f, d))  # up
        self.w2 = nn.Parameter(torch.empty(e, d, f))  # down
        self.aux_scale = 1.0
        """The aux loss's weight in one backward: 1, or 1 / micro-batches in a pipeline
        (each micro-batch's loss is divided by their count). Set by the trainer."""
        self.last_aux_loss: torch.Tensor | None = None
        """The load-balancing loss of the last forward (before ``aux_loss_coef``)."""

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
        out = torch.zeros_like(tokens)
        # Every expert runs, even on no tokens: then every rank's backward reaches
        # every expert weight, and FSDP2's reduce-scatter sees the same gradients
        # everywhere.
        for e in range(self.w1.shape[0]):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            h = tokens.index_select(0, rows)
            y = F.linear(F.silu(F.linear(h, self.w1[e])) * F.linear(h, self.w3[e]), self.w2[e])
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1))
        self.last_aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AddAuxGradient.apply(out, aux, self.aux_loss_coef * self.aux_scale)
        return out.view(b, t, d)
