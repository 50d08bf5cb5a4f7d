"""What a site's training step is configured with and reports, and its seam to the
cross-site layer (``GradientSync``): the types ``intra.train.Trainer`` uses, apart so that
the trainer's module holds the step itself."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["GradientSync", "StepStats", "SyncResult", "TrainConfig"]


class SyncResult(Protocol):
    """What ``GradientSync.finish`` returns; intra reads only whether it committed and
    hands the rest back to its caller (``StepStats.sync``)."""

    @property
    def committed(self) -> bool: ...


@runtime_checkable
class GradientSync(Protocol):
    """Averages gradient shards across sites; implemented in ``isthmus.inter``.

    ``start`` is called from FSDP2's all-reduce hook, once per FSDP group per
    step, in backward order (root last on CPU; do not rely on the order, use
    ``group``). ``shard`` is the group's flat 1-D reduce-scatter output,
    already averaged over the site's dp ranks; the sharded gradients are views
    of it, so overwriting it in place (before ``finish`` returns) is how the
    cross-site average reaches the optimizer. On CUDA it is called inside
    FSDP2's all-reduce stream. ``step`` is the training step, the same number at
    every site (it names the step's rounds). ``finish`` returns whether the step
    committed: a step that did not (the job went on without this site) leaves the
    shards and the optimizer untouched.
    """

    def start(self, step: int, group: int, shard: torch.Tensor) -> None: ...

    def finish(self, step: int) -> SyncResult: ...


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimizer and schedule."""

    lr: float = 1e-3
    """Peak learning rate."""
    warmup_steps: int = 10
    """Linear warmup steps from ``lr / warmup_steps`` to ``lr``."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor, as a fraction of ``lr``, reached at ``total_steps``."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (applied to every parameter)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float | None = 1.0
    """Max global gradient norm; ``None`` disables clipping."""
    portable_clip: bool = False
    """Clip by a norm that does not depend on how the site shards the gradient: the
    squares summed in fp64 and the norm rounded to 16 significant bits. Sites of
    different sizes sum their shards in different orders; with equal layouts (the
    default off) the norms are bitwise equal anyway. Two sites' fp64 norms differ by
    ~1e-15 relative, so they round apart only when one lies that close to the edge of
    a 2**-16-wide bucket: ~1e-10 per clipped step."""
    total_steps: int = 1000
    """Length of the schedule."""
    accumulate: int = 1
    """Micro-batches whose gradients one step sums: the batch handed to ``step`` is cut
    into this many, each forward and backward on its own, the site's reduce-scatter
    (and the cross-site sync) once after the last. Needs ``pp == 1``."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if not self.accumulate >= 1:
            raise ValueError(f"TrainConfig.accumulate must be >= 1, got {self.accumulate!r}")
        if not self.total_steps >= 1:
            raise ValueError(f"TrainConfig.total_steps must be >= 1, got {self.total_steps!r}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"TrainConfig.warmup_steps must be in [0, total_steps={self.total_steps}], "
                f"got {self.warmup_steps!r}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}"
            )
        if not self.weight_decay >= 0:
            raise ValueError(f"TrainConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig.betas must be two values in [0, 1), got {self.betas!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"TrainConfig.grad_clip must be > 0 or None, got {self.grad_clip!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of ``step``: linear warmup, then cosine to ``min_lr_ratio * lr``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * self._progress(step)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def decayed_at(self, step: int) -> float:
        """How far the cosine has taken the learning rate from its peak toward its floor
        at ``step``: 0 through the warmup and at the peak, 1 at the schedule's end."""
        if step < self.warmup_steps:
            return 0.0
        return 0.5 * (1.0 - math.cos(math.pi * self._progress(step)))

    def _progress(self, step: int) -> float:
        """The fraction of the cosine's steps (those after the warmup) done at ``step``."""
        return min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))


@dataclass(slots=True)
class StepStats:
    """What one step did, on this rank."""

    step: int
    loss: float  # mean over the site's global batch (averaged over dp ranks)
    grad_norm: float  # global, before clipping (after the cross-site average)
    lr: float
    compute_s: float  # the step's wall time minus sync_s (intra-site communication in)
    sync_s: float  # inside GradientSync.finish()
    tokens: int  # in this rank's batch (tp and pp ranks of one dp rank share them)
    site_tokens: int = 0  # the whole site's this step: tokens * dp
    mfu: float = 0.0  # the site's model FLOPs utilization over the step (sync included)
    sync: SyncResult | None = None
    """What ``GradientSync.finish`` returned (None without a sync). When it did not
    commit, the optimizer did not step and ``grad_norm`` is 0."""
    moe_aux_loss: float | None = None
    """Mixture of experts: the load-balancing loss (1 = balanced), the mean over the
    site's expert layers; None for a dense model."""
    moe_load_ratio: float | None = None
    """Mixture of experts: the busiest expert's routed copies over the mean (1 =
    balanced, at most n_experts / top_k), the mean over the site's expert layers and
    ranks (each over its own tokens); None for a dense model."""
    moe_dropped: float | None = None
    """Mixture of experts: the share of routed copies the capacity dropped (0 when
    dropless), the same mean; None for a dense model."""

    def moe_metrics(self) -> dict[str, float]:
        """The mixture-of-experts statistics as metrics.jsonl keys; {} for a dense model."""
        names = ("moe_aux_loss", "moe_load_ratio", "moe_dropped")
        return {k: v for k in names if (v := getattr(self, k)) is not None}

    @property
    def committed(self) -> bool:
        """The step's update was applied (always, without a sync)."""
        return self.sync is None or self.sync.committed
