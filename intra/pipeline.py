"""Pipeline parallelism inside a site: layer-split stages and ``torch.distributed.pipelining``.

The model is cut into ``pp * stages_per_rank`` stages of consecutive layers; the
first stage also holds the embedding, the last the final norm and the head.
Stages are assigned round-robin ("loop" order, what the interleaved schedule
expects): pp rank ``p`` holds stages ``p, p + pp, p + 2 pp, ...``.

Gradient placement with FSDP2: the pipelining runtime turns FSDP's gradient
reduction off for every micro-batch's backward and reduces once, after the last,
in ``perform_reduce_grad`` -- so each FSDP group reduce-scatters (and calls its
all-reduce hook) exactly once per step. Gradients are scaled by ``1 /
microbatches`` inside the loss, not by the schedule's ``scale_grads``, because
``scale_grads`` divides the shards *after* the hook handed them to the
cross-site sync, which may already have copied them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .layout import PipelineSchedule
from .model import Transformer


def stage_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Layer indices of each stage: contiguous, sizes differing by at most one
    (earlier stages take the remainder; the last also runs the head)."""
    if n_layers < num_stages:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(n_layers, num_stages)
    start = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [list(range(start[s], start[s + 1])) for s in range(num_stages)]


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def split_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """A ``Transformer`` holding only ``stage``'s part of ``model``, sharing its
    submodules and keeping their global names."""
    layers = stage_layers(model.cfg.n_layers, num_stages)[stage]
    with torch.device("meta"):
        part = Transformer(model.cfg)
    part.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
    part.tok_embeddings = model.tok_embeddings if stage == 0 else None
    last = stage == num_stages - 1
    part.norm = model.norm if last else None
    part.output = model.output if last else None
    part.rope = model.rope
    return part


class MicrobatchLoss:
    """Cross-entropy of one micro-batch, divided by the micro-batch count, so the
    gradients summed over micro-batches are those of the mean loss over the batch."""

    def __init__(self, microbatches: int) -> None:
        self.microbatches = microbatches

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return loss / self.microbatches


def build_schedule(
    parts: Sequence[nn.Module],
    stages: list[int],
    num_stages: int,
    *,
    schedule: str,
    microbatches: int,
    group: dist.ProcessGroup,
    device: torch.device,
):
    """Wrap this rank's stage modules (parallelized, one per index in ``stages``) in
    ``PipelineStage``s and a schedule over the pp ``group``: call ``step(inputs)`` on the
    first stage's rank, ``step(target=..., losses=[])`` on the last's, ``step()`` elsewhere.
    """
    # Here, not at the top: only pp > 1 builds a schedule. The package costs ~20 ms, and
    # imports torch._dynamo (~0.5 s) in a process whose DTensors have not yet.
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pipeline_stages = [
        PipelineStage(part, index, num_stages, device, group=group)
        for part, index in zip(parts, stages, strict=True)
    ]
    loss_fn = MicrobatchLoss(microbatches)
    common: dict[str, Any] = {"n_microbatches": microbatches, "loss_fn": loss_fn}
    common["scale_grads"] = False  # the loss divides (see the module docstring)
    if schedule == PipelineSchedule.GPIPE:
        return ScheduleGPipe(pipeline_stages[0], **common)
    if schedule == PipelineSchedule.ONE_F_ONE_B:
        return Schedule1F1B(pipeline_stages[0], **common)
    # torch types the stages as list[_PipelineStageBase] (invariant), not Sequence.
    return ScheduleInterleaved1F1B(pipeline_stages, **common)  # type: ignore[arg-type]
