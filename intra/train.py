"""The training step of one site, and its seam to the cross-site layer.

Gradient placement, per step:
1. forward/backward; FSDP2 reduce-scatters each group's gradient inside the
   site (averaging over the site's ``dp`` ranks) and hands the flat shard to the
   all-reduce hook, which calls ``GradientSync.start(group, shard)``;
2. ``GradientSync.finish()`` waits until every shard has been overwritten, in
   place, with the average over all sites (or raises: then nothing is applied);
3. the gradient norm is clipped -- after the sync, so every site computes the
   same norm -- and the sharded AdamW steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .parallel import apply_fsdp, dp_mesh


@runtime_checkable
class GradientSync(Protocol):
    """Averages gradient shards across sites; implemented in ``isthmus.inter``.

    ``start`` is called from FSDP2's all-reduce hook, once per FSDP group per
    step, in backward order (root last on CPU; do not rely on the order, use
    ``group``). ``shard`` is the group's flat 1-D reduce-scatter output,
    already averaged over the site's dp ranks; the sharded gradients are views
    of it, so overwriting it in place (before ``finish`` returns) is how the
    cross-site average reaches the optimizer. On CUDA it is called inside
    FSDP2's all-reduce stream.
    """

    def start(self, group: int, shard: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


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
    total_steps: int = 1000
    """Length of the schedule."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
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
        progress = min(
            1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        )
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


@dataclass(slots=True)
class StepStats:
    """What one step did, on this rank."""

    step: int
    loss: float
    """Mean loss over the site's global batch (all-reduced over dp ranks)."""
    grad_norm: float
    """Global gradient norm before clipping (after the cross-site average)."""
    lr: float
    compute_s: float
    """Wall time of the step minus ``sync_s``."""
    sync_s: float
    """Time spent inside ``GradientSync.finish()``."""
    tokens: int
    """Tokens this rank processed."""


def _hook(sync: GradientSync, group: int) -> Callable[[torch.Tensor], None]:
    # A factory, so each hook binds its own group index.
    def hook(shard: torch.Tensor) -> None:
        sync.start(group, shard)

    return hook


class Trainer:
    """Owns the site's FSDP2 model, its AdamW and the step.

    Args:
        model: the unsharded model from ``build_model`` (sharded in place here).
        mesh: the site mesh from ``build_site_mesh``; its device type is used.
        config: optimizer and schedule.
        sync: the cross-site gradient sync; ``None`` for a single site (no hook).
        mixed_precision: bf16 compute with fp32 gradient reduction (CUDA only).
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        config: TrainConfig,
        *,
        sync: GradientSync | None = None,
        mixed_precision: bool = False,
    ) -> None:
        self.config, self.sync, self.mesh = config, sync, mesh
        if mesh.device_type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device(mesh.device_type)
        mp_policy = None
        if mixed_precision:
            if mesh.device_type != "cuda":
                raise ValueError(
                    "mixed_precision=True needs device_type='cuda' (bf16 on CPU is slow)"
                )
            # reduce_dtype stays fp32 = the sharded parameters' dtype: FSDP2 then
            # averages inside the collective (ReduceOp.AVG) before the hook and
            # the sharded grads alias the hook's shard (see apply_fsdp).
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.groups = apply_fsdp(model, mesh, mp_policy=mp_policy)
        self.model = model
        self._dp_group = dp_mesh(mesh).get_group()
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            foreach=True,
        )
        if sync is not None:
            for i, group in enumerate(self.groups):
                group.set_all_reduce_hook(_hook(sync, i))

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, step_index: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepStats:
        """One optimizer step on this rank's batch.

        Args:
            step_index: the global step (drives the LR schedule).
            inputs: int64 ``[batch, seq]`` token ids.
            targets: int64 ``[batch, seq]`` next-token ids.

        Returns:
            The step's stats.

        Raises:
            Whatever ``sync.finish()`` raises; the optimizer has then not stepped.
        """
        t0 = time.perf_counter()
        # set_to_none is required: with an existing grad FSDP2 accumulates a *copy*
        # of the reduced shard, and the sync's later in-place write would be lost.
        self.optimizer.zero_grad(set_to_none=True)
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        sync_s = 0.0
        if self.sync is not None:
            self._sync_device()
            t_sync = time.perf_counter()
            self.sync.finish()
            sync_s = time.perf_counter() - t_sync
        grad_norm = self._clip()
        lr = self.config.lr_at(step_index)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        site_loss = loss.detach().clone()
        dist.all_reduce(site_loss, op=dist.ReduceOp.SUM, group=self._dp_group)
        loss_value = site_loss.item() / dist.get_world_size(self._dp_group)
        self._sync_device()
        total = time.perf_counter() - t0
        return StepStats(
            step=step_index,
            loss=loss_value,
            grad_norm=grad_norm,
            lr=lr,
            compute_s=total - sync_s,
            sync_s=sync_s,
            tokens=inputs.numel(),
        )

    def _clip(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # On DTensor grads the norm is a DTensor whose reduction spans the dp
        # ranks; full_tensor() completes it so every rank sees the same value.
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(
                self.model.parameters(), self.config.grad_clip, norm, foreach=True
            )
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm.item())
