"""A Llama-style decoder (docs/models.md); the rotary layout is Hugging Face's.

Layers live in ``Transformer.layers``, an ``nn.ModuleDict`` keyed by the layer's global
index: parameter names are a ``ModuleList``'s, and a pipeline stage that keeps only some
layers keeps their names (torchtitan's habit).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .context_parallel import ContextShard
from .model_config import ModelConfig
from .moe import MoEFeedForward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 so bf16 activations keep their precision here.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """The ``head_dim / 2`` rotary frequencies, with Llama 3's scaling when the config
    has it (the arithmetic of transformers' ``_compute_llama3_parameters``, so a model
    loaded from Hugging Face gives the same logits)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=device).float() / half))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, those between blended.
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


def rotary_tables(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """``[max_seq_len, head_dim]``: cos in the first half, sin in the second."""
    inv_freq = rotary_frequencies(cfg, device)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, heads, seq, head_dim]`` (half-split pairing)."""
    half = x.shape[-1] // 2
    cos, sin = table[: x.shape[-2], :half], table[: x.shape[-2], half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        kv = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, kv, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.context: ContextShard | None = None  # context parallelism: parallelize sets

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            # -1, not n_heads: under tensor parallelism q/k/v are column shards
            # holding n_heads / tp (n_kv_heads / tp) whole heads.
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        if self.context is not None:
            out = self.context.attend(q, k, v)
        else:
            # Grouped-query attention: query head h reads key/value head h // (n_heads /
            # n_kv_heads), as Hugging Face's repeat_kv; tp shards keep whole groups.
            gqa = k.shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = MoEFeedForward(cfg) if cfg.n_experts else FeedForward(cfg)
        # Recompute activations in backward (parallelize sets it): a flag rather than
        # checkpoint_wrapper, so parameter names do not change.
        self.checkpoint = False

    def _forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


class Transformer(nn.Module):
    """The decoder: ``tokens [batch, seq] -> logits [batch, seq, vocab]``.

    A pipeline stage (see ``pipeline.split_stage``) may lack ``tok_embeddings``
    (it then takes hidden states ``[batch, seq, dim]``) or ``norm``/``output``
    (it then returns hidden states).
    """

    rope: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Not persistent: derived from the config, so it stays out of checkpoints and digests.
        self.register_buffer("rope", rotary_tables(cfg), persistent=False)
        # Context parallelism (parallelize sets it): tokens are this rank's chunks of
        # each sequence, rotated by their global positions.
        self.context: ContextShard | None = None

    def tie_weights(self) -> None:
        """With ``cfg.tie_embeddings``, make the head's weight the embedding's: one
        parameter under two names, which ``named_parameters()`` (checkpoints, digests,
        FSDP) lists once, as ``tok_embeddings.weight``. Called again by whatever swaps
        parameters (``to_empty``, tensor parallelism), which would untie them."""
        if self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens.shape[1]
        cp = self.context.size if self.context is not None else 1
        if local * cp > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {local * cp} exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        rope = self.rope
        if self.context is not None:
            rope = rope.index_select(0, self.context.positions(local, rope.device))
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.output is None:
            return h
        assert self.norm is not None  # a stage holds both or neither (split_stage)
        return self.output(self.norm(h)).float()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Initialize every parameter from ``generator`` (same seed, same weights)."""
        std = self.cfg.init_std
        # GPT-2/Llama habit: shrink the projections that write into the residual
        # stream so its variance does not grow with depth.
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.trunc_normal_(
                    p, std=out_std, a=-3 * out_std, b=3 * out_std, generator=generator
                )
            else:
                nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std, generator=generator)
        self.rope.copy_(rotary_tables(self.cfg, self.rope.device))

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Without the input lookup table, or (``active``, on the whole model) the experts
        a token is not routed to."""
        n = sum(p.numel() for p in self.parameters())
        # A tied head is a matmul as well as the lookup: its weight stays counted.
        if exclude_embedding and self.tok_embeddings is not None and not self.cfg.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n - (self.cfg.inactive_params if active else 0)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: ``6 N + 12 L d T`` (PaLM appendix B), ``N`` without
        the input embedding (a lookup) and the experts a token is not routed to; the
        second term is attention's matmuls. Call it on the whole model (meta is fine):
        a pipeline stage or a TP shard counts only its own part."""
        t = self.cfg.max_seq_len if seq_len is None else seq_len
        return flops_per_token(self.cfg, self.num_params(exclude_embedding=True, active=True), t)


def flops_per_token(cfg: ModelConfig, params_without_embedding: int, seq_len: int) -> float:
    return 6 * params_without_embedding + 12 * cfg.n_layers * cfg.dim * seq_len


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The fp32 model on CPU with weights drawn from ``seed``: every rank of every site
    starts from identical weights without any broadcast. Built on the meta device, so
    the global RNG is left untouched and large presets skip a throwaway default init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty made a new parameter for each name
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    model.init_weights(generator)
    return model
