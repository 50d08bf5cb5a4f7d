"""The training step of one site, and its seam to the cross-site layer.

Gradient placement, per step:
1. forward/backward (through the pipeline schedule when ``pp > 1``); FSDP2 reduce-scatters
   each group's gradient inside the site, once per step (averaging over the site's ``dp``
   ranks; with TP each tp rank reduces its own TP shard) and hands the flat shard to the
   all-reduce hook, which calls ``GradientSync.start(step, group, shard)`` (with
   ``parallel.offload`` the gradients are host copies made after the hook, so the trainer
   starts the sync after backward, on each group's host gradients as one flat tensor);
2. ``GradientSync.finish(step)`` waits until every shard has been overwritten, in place,
   with the average over all sites, and says whether the step committed (or raises): a
   step that did not commit applies nothing;
3. with a head tied to the embedding and ``pp > 1``, the first and the last stage's
   copies of the tied weight get the sum of their gradients (intra/tied.py);
4. the gradient norm is clipped -- after the sync, so every site computes the same norm
   -- and the sharded AdamW steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from math import prod
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .digest import local_shard, parameter_digest
from .flops import device_peak_flops, mfu
from .layout import MeshAxis, ParallelConfig
from .model import Transformer, flops_per_token
from .moe import MoEFeedForward
from .parallel import context_shard, expert_parallel_mesh, group_parameters, parallelize
from .pipeline import build_schedule, rank_stages, split_stage
from .tied import TiedEmbedding, tied_embedding
from .topology import mesh_coordinate
from .train_types import GradientSync, StepStats, SyncResult, TrainConfig

__all__ = ["GradientSync", "StepStats", "SyncResult", "TrainConfig", "Trainer", "mesh_pp_group"]


def _round_bits(x: float, bits: int) -> float:
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * (1 << bits)) / (1 << bits), exponent)


def _axis_size(mesh: DeviceMesh, axis: MeshAxis) -> int:
    names = mesh.mesh_dim_names or ()
    if axis.value in names:
        return mesh[axis.value].size()
    return mesh.size() if axis is MeshAxis.DP and mesh.ndim == 1 else 1


def _resolved_parallel(
    parallel: ParallelConfig | None, mixed_precision: bool, device_type: str
) -> ParallelConfig:
    parallel = parallel if parallel is not None else ParallelConfig()
    if mixed_precision:
        parallel = replace(parallel, mixed_precision=True)
    if parallel.mixed_precision and device_type != "cuda":
        raise ValueError("mixed_precision needs device_type='cuda' (bf16 on CPU is slow)")
    return parallel


def _rank_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class Trainer:
    """Owns the site's parallelized model parts (``model_parts``: the whole model, or this
    rank's pipeline stages), their AdamW and the step.

    ``model`` (from ``build_model``) is parallelized in place; ``parallel=None`` means
    ``ParallelConfig()``, ``mixed_precision`` a shorthand for its flag; ``sync=None``: a
    single site, no hook. ``groups`` are the FSDP groups as ``GradientSync.start`` numbers
    them; ``model`` is the whole model when ``pp == 1``, else ``None``.
    """

    def __init__(
        self,
        model: Transformer,
        mesh: DeviceMesh,
        config: TrainConfig,
        *,
        parallel: ParallelConfig | None = None,
        sync: GradientSync | None = None,
        mixed_precision: bool = False,
    ) -> None:
        parallel = _resolved_parallel(parallel, mixed_precision, mesh.device_type)
        self.config, self.sync, self.mesh, self.parallel = config, sync, mesh, parallel
        self.step_in_progress = 0  # the step whose backward runs (the sync hooks name rounds by it)
        self.device = _rank_device(mesh)
        self.pp, self.dp, self.cp, self.tp = (_axis_size(mesh, a) for a in MeshAxis)
        self.coordinate = (
            mesh_coordinate(mesh) if mesh.mesh_dim_names else (0, mesh.get_local_rank(), 0, 0)
        )
        self._context = context_shard(mesh)
        self._model_cfg = model.cfg
        self._params_no_embedding = model.num_params(exclude_embedding=True, active=True)
        self._peak = device_peak_flops(self.device)
        if self.pp > 1:
            num_stages = self.pp * parallel.local_stages
            self.stages = rank_stages(self.coordinate[0], self.pp, parallel.local_stages)
            self.model_parts = [split_stage(model, s, num_stages) for s in self.stages]
        else:
            num_stages, self.stages, self.model_parts = 1, [0], [model]
        self.groups = self._parallelize_parts()
        # A head tied to the embedding with pp > 1: this rank's copy (intra/tied.py).
        self.tied: TiedEmbedding | None = tied_embedding(self.model_parts, mesh, self.device)
        self.model = self.model_parts[0] if self.pp == 1 else None
        self._is_first, self._is_last = 0 in self.stages, num_stages - 1 in self.stages
        self.schedule = self._pipeline_schedule(num_stages) if self.pp > 1 else None
        self._moe_layers = [
            m for part in self.model_parts for m in part.modules() if isinstance(m, MoEFeedForward)
        ]
        if self.pp > 1 and config.accumulate > 1:
            raise ValueError(
                "TrainConfig.accumulate > 1 needs pp == 1 (pipelines have micro-batches)"
            )
        # Each micro-batch's loss is divided by their count: its aux loss too.
        count = parallel.num_microbatches(self.pp) if self.pp > 1 else config.accumulate
        for layer in self._moe_layers:
            layer.aux_scale = 1.0 / count
        self.optimizer = torch.optim.AdamW(
            self.parameters(),
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
            foreach=True,
        )
        # With offload the sharded gradients are host copies FSDP2 makes right after
        # the all-reduce hook, so an in-place write to the hook's shard would be lost:
        # the sync then runs after backward on the host gradients themselves.
        self._offloaded = [group_parameters(g) for g in self.groups] if parallel.offload else []
        if sync is not None and not parallel.offload:
            for i, group in enumerate(self.groups):
                group.set_all_reduce_hook(partial(self._hook, i))

    def _hook(self, group: int, shard: torch.Tensor) -> None:
        # FSDP group `group`'s all-reduce hook, run inside the backward of step_in_progress.
        assert self.sync is not None
        self.sync.start(self.step_in_progress, group, shard)

    def _parallelize_parts(self) -> list[FSDPModule]:
        ep = self.parallel.expert_parallel
        # One expert mesh for all of this rank's stages: each mesh is new process groups.
        experts = expert_parallel_mesh(self.mesh, ep) if ep > 1 else None
        return [
            g
            for part in self.model_parts
            for g in parallelize(part, self.mesh, self.parallel, expert_mesh=experts)
        ]

    def _pipeline_schedule(self, num_stages: int) -> Any:  # build_schedule's, unannotated
        return build_schedule(
            self.model_parts,
            self.stages,
            num_stages,
            schedule=self.parallel.schedule,
            microbatches=self.parallel.num_microbatches(self.pp),
            group=self.mesh[MeshAxis.PP.value].get_group(),
            device=self.device,
        )

    def set_accumulate(self, micro_batches: int) -> None:
        """Sums this many micro-batches per step from the next step on (the sites'
        split of the global batch changed: deploy/balance.py)."""
        if micro_batches < 1 or self.pp > 1:
            raise ValueError(
                f"set_accumulate({micro_batches}) needs a count >= 1 and pp == 1 (got pp="
                f"{self.pp}): pipelines have micro-batches of their own"
            )
        self.config.accumulate = micro_batches
        for layer in self._moe_layers:
            layer.aux_scale = 1.0 / micro_batches

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run forward and backward; return this rank's loss (0 off the last stage)."""
        if self.schedule is not None:
            return self._scheduled(self.schedule.step, inputs, targets)
        assert self.model is not None  # pp == 1: the one part is the whole model
        m = self.config.accumulate
        if inputs.shape[0] % m:
            raise ValueError(f"a batch of {inputs.shape[0]} does not split into {m} micro-batches")
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m), strict=True)):
            if m > 1:  # gradients add up unsharded; the last backward reduce-scatters
                # them (and its all-reduce hook starts the cross-site sync) once.
                cast(FSDPModule, self.model).set_requires_gradient_sync(i == m - 1)
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()) / m
            loss.backward()
            total += loss.detach()
        return total

    def _scheduled(
        self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The schedule's ``run`` (step or eval): this rank's loss, 0 off the last stage."""
        args = (inputs,) if self._is_first else ()
        losses: list[torch.Tensor] = []
        run(*args, **({"target": targets, "losses": losses} if self._is_last else {}))
        if not self._is_last:
            return torch.zeros((), device=self.device, dtype=torch.float32)
        # Each micro-batch loss is already divided by the count (MicrobatchLoss).
        return torch.stack([x.detach().float() for x in losses]).sum()

    def step(self, step_index: int, inputs: torch.Tensor, targets: torch.Tensor) -> StepStats:
        """One optimizer step on this rank's batch: int64 ``[batch, seq]`` token ids and
        next-token ids, the same at every rank of a dp replica (its tp and pp ranks);
        ``step_index`` (the global step) drives the LR schedule. The optimizer does not
        step when ``sync.finish()`` raises or says the step did not commit."""
        t0 = time.perf_counter()
        self.step_in_progress = step_index
        # set_to_none is required: with an existing grad FSDP2 accumulates a *copy*
        # of the reduced shard, and the sync's later in-place write would be lost.
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(*self._local(inputs, targets))
        sync_s, synced = self._sync_across_sites(step_index)
        lr = self.config.lr_at(step_index)
        grad_norm = 0.0
        if synced is None or synced.committed:
            if self.tied is not None:  # after the sync: each copy's mean over the sites
                self.tied.sum_gradients()
            grad_norm = self._clip()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        site_loss, aux_sum, load_sum, dropped_sum, moe_count = self._site_sums(loss)
        loss_value = site_loss / (self.dp * self.cp * self.tp)
        self._sync_device()
        total = time.perf_counter() - t0
        site_tokens = inputs.numel() * self.dp
        fpt = flops_per_token(self._model_cfg, self._params_no_embedding, inputs.shape[1])
        return StepStats(
            step=step_index,
            loss=loss_value,
            grad_norm=grad_norm,
            lr=lr,
            compute_s=total - sync_s,
            sync_s=sync_s,
            tokens=inputs.numel(),
            site_tokens=site_tokens,
            mfu=mfu(site_tokens / total, fpt, self._peak, dist.get_world_size()),
            sync=synced,
            moe_aux_loss=aux_sum / moe_count if moe_count else None,
            moe_load_ratio=load_sum / moe_count if moe_count else None,
            moe_dropped=dropped_sum / moe_count if moe_count else None,
        )

    def _sync_across_sites(self, step_index: int) -> tuple[float, SyncResult | None]:
        """(seconds, result) of this step's cross-site sync (started by the hooks, or here
        when the gradients are offloaded); (0, None) without a sync."""
        if self.sync is None:
            return 0.0, None
        self._sync_device()
        t_sync = time.perf_counter()
        flats = self._start_offloaded(self.sync, step_index) if self._offloaded else []
        synced = self.sync.finish(step_index)
        if flats and synced.committed:
            self._apply_offloaded(flats)
        return time.perf_counter() - t_sync, synced

    def _site_sums(self, loss: torch.Tensor) -> list[float]:
        """[loss, MoE aux loss, load ratio, dropped share, MoE layer count], each summed
        over the site's ranks in one all-reduce. Only last-stage ranks hold a loss (the
        sum counts each replica's tp times); a middle stage has MoE layers, the last the
        loss, so the stats travel with their count and the site's mean comes free."""
        moe = [m.last_stats for m in self._moe_layers if m.last_stats is not None]
        moe_sum = torch.stack(moe).sum(0).to(loss.device) if moe else loss.new_zeros(3)
        site = torch.cat(
            [loss.float().reshape(1), moe_sum.float(), loss.new_full((1,), float(len(moe)))]
        )
        dist.all_reduce(site, op=dist.ReduceOp.SUM)
        return site.tolist()

    def _local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return [local_shard(p.grad) for p in params if p.grad is not None]

    def _start_offloaded(self, sync: GradientSync, step: int) -> list[torch.Tensor]:
        """The hooks' work when gradients are offloaded: each group's host gradients, as
        one flat fp32 tensor (the same layout at every site), to the sync."""
        flats = []
        for i, params in enumerate(self._offloaded):
            local = self._local_grads(params)
            flat = torch.cat([g.reshape(-1).float() for g in local]) if local else torch.empty(0)
            sync.start(step, i, flat)
            flats.append(flat)
        return flats

    def _apply_offloaded(self, flats: list[torch.Tensor]) -> None:
        for params, flat in zip(self._offloaded, flats, strict=True):
            offset = 0
            for g in self._local_grads(params):
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _clip(self) -> float:
        """Global gradient norm over the site (all stages), then clip by it."""
        params = [p for p in self.parameters() if p.grad is not None]
        grads = [cast(torch.Tensor, p.grad) for p in params]
        # The head's copy of a tied weight holds the same gradient as the embedding's:
        # the norm counts that weight once (both copies are still clipped below).
        head_copy = self.tied.weight if self.tied is not None and self.tied.is_head else None
        # Each rank adds the squares of its local shards, weighted by 1/(copies of that
        # shard inside the stage's dp*tp ranks) -- a norm weight without sequence
        # parallelism, say, is replicated over tp -- so one sum over the site's ranks
        # counts every element once. Copies are counted from the Replicate placements
        # (FSDP+TP shards are Shard/_StridedShard, never Partial after the reduce-scatter)
        # and the mesh axes the DTensor does not span. The order of additions is fixed
        # by the layout, so equal layouts give equal norms.
        stage_ranks = self.dp * self.cp * self.tp
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, g in zip(params, grads, strict=True):
            if p is head_copy:
                continue
            copies = stage_ranks
            if isinstance(g, DTensor):
                mesh = g.device_mesh
                replicated = prod(
                    mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate()
                )
                copies = replicated * stage_ranks // mesh.size()
                g = g.to_local()
            squares = g.double().pow(2) if self.config.portable_clip else g.float().pow(2)
            total += squares.sum().double() / copies
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        norm = float(total.sqrt().item())
        clip = self.config.grad_clip
        if clip is not None and grads:
            by = _round_bits(norm, 16) if self.config.portable_clip else norm
            coef = clip / (by + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(self._local_grads(params), coef)
        return norm

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The model's mean cross-entropy on one batch, no update (a collective): the same
        value at every rank of the site when every replica has the same batch (the last
        pipeline stage shares its loss); a replica's ranks pass the same batch."""
        try:
            loss = self._evaluate(*self._local(inputs, targets))
            if self._context is not None:  # each cp rank's mean over equal token counts
                dist.all_reduce(loss, group=self._context.group)
                loss /= self.cp
            return float(loss.item())
        finally:
            # FSDP keeps the root and the last block gathered after a forward (backward
            # needs them first): free them, or the next forward reuses copies that are
            # stale once the parameters change (a step, the outer modes' anchor swaps).
            for group in self.groups:
                group.reshard()

    def _local(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of the replica's batch (with cp, its two chunks of each)."""
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        if self._context is None:
            return inputs, targets
        return self._context.shard(inputs), self._context.shard(targets)

    def _evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.schedule is None:
            assert self.model is not None
            logits = self.model(inputs)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss = self._scheduled(self.schedule.eval, inputs, targets)
        dist.all_reduce(loss, group=mesh_pp_group(self.mesh))  # only the last stage's is not 0
        return loss

    def parameter_digest(self) -> str:
        """sha256 of the site's full parameters (a collective over the whole site): that of
        the unsplit model when ``pp == 1``, else a digest over the stages' digests."""
        return parameter_digest(
            self.model_parts, pp_group=mesh_pp_group(self.mesh) if self.pp > 1 else None
        )


def mesh_pp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    return mesh[MeshAxis.PP.value].get_group()
