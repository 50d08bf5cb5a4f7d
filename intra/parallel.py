"""How one site parallelizes the model: the validated ``ParallelConfig`` and ``parallelize``.

Order of application on each model part (torchtitan's order): tensor parallelism
(DTensor plans over ``tp``), activation checkpointing, ``torch.compile`` per
block, then FSDP2 over ``dp`` -- 2-D with TP, since the TP parameters are
already DTensors on the ``tp`` axis of the same mesh. Pipeline stages are cut
before any of this (``pipeline.py``) and each stage is parallelized on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .model import ModelConfig
from .tensor_parallel import apply_tp
from .topology import MeshAxis, ParallelLayout, StrEnum


class PipelineSchedule(StrEnum):
    """``torch.distributed.pipelining`` schedules."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Techniques a site uses on top of its ``ParallelLayout`` (pp × dp × tp sizes)."""

    schedule: str = PipelineSchedule.ONE_F_ONE_B.value
    """Pipeline schedule when ``pp > 1``: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``."""
    microbatches: int | None = None
    """Micro-batches per step when ``pp > 1``; must divide the per-rank batch.
    ``None``: ``pp * stages_per_rank`` (the fewest that keep every stage busy)."""
    stages_per_rank: int | None = None
    """Pipeline stages (layer chunks) each pp rank holds. ``None``: 2 for
    ``interleaved_1f1b`` (it needs >= 2), else 1 (``gpipe``/``1f1b`` need exactly 1)."""
    sequence_parallel: bool = False
    """With ``tp > 1``: shard norms and the residual stream along the sequence
    (Megatron SP); saves activation memory, turns all-reduces into
    reduce-scatter + all-gather. Needs ``seq_len`` divisible by ``tp``."""
    activation_checkpoint: bool = False
    """Recompute each block's activations in backward (full, per block)."""
    compile: bool = False
    """``torch.compile`` each transformer block (on CPU this needs a C compiler)."""
    mixed_precision: bool = False
    """bf16 compute with fp32 parameters and fp32 gradient reduction (CUDA only)."""

    def __post_init__(self) -> None:
        allowed = [s.value for s in PipelineSchedule]
        if self.schedule not in allowed:
            raise ValueError(
                f"ParallelConfig.schedule must be one of {allowed}, got {self.schedule!r}"
            )
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"ParallelConfig.{name} must be an integer >= 1, got {value!r}")
        interleaved = self.schedule == PipelineSchedule.INTERLEAVED_1F1B
        if self.stages_per_rank is not None:
            if interleaved and self.stages_per_rank < 2:
                raise ValueError(
                    "ParallelConfig.stages_per_rank must be >= 2 for interleaved_1f1b, "
                    f"got {self.stages_per_rank}"
                )
            if not interleaved and self.stages_per_rank != 1:
                raise ValueError(
                    f"ParallelConfig.stages_per_rank must be 1 for {self.schedule}, "
                    f"got {self.stages_per_rank}"
                )
        for name in ("sequence_parallel", "activation_checkpoint", "compile", "mixed_precision"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ParallelConfig.{name} must be true or false, got {getattr(self, name)!r}"
                )

    @property
    def local_stages(self) -> int:
        """Pipeline stages per pp rank (``stages_per_rank`` resolved)."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule == PipelineSchedule.INTERLEAVED_1F1B else 1

    def num_microbatches(self, pp: int) -> int:
        """Micro-batches per step for ``pp`` ranks (``microbatches`` resolved)."""
        return self.microbatches if self.microbatches is not None else pp * self.local_stages

    def check(
        self, layout: ParallelLayout, model: ModelConfig, *, batch_size: int, seq_len: int
    ) -> None:
        """Check this config against a layout, a model shape and the per-rank batch.

        Args:
            layout: the site's pp × dp × tp.
            model: the model shape.
            batch_size: sequences per dp rank per step.
            seq_len: tokens per sequence.

        Raises:
            ValueError: naming the field that does not fit.
        """
        tp = layout.tp
        for name in ("n_heads", "ffn_hidden", "vocab_size", "dim"):
            if getattr(model, name) % tp:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(model, name)} must be divisible by "
                    f"ParallelLayout.tp={tp}"
                )
        if self.sequence_parallel and tp > 1 and seq_len % tp:
            raise ValueError(
                f"ParallelConfig.sequence_parallel needs seq_len={seq_len} divisible by tp={tp}"
            )
        if self.mixed_precision and not torch.cuda.is_available():
            raise ValueError("ParallelConfig.mixed_precision needs CUDA (bf16 on CPU is slow)")
        if layout.pp == 1:
            return
        stages = layout.pp * self.local_stages
        if model.n_layers < stages:
            raise ValueError(
                f"ModelConfig.n_layers={model.n_layers} is fewer than the pipeline stages "
                f"pp*stages_per_rank={stages}"
            )
        micro = self.num_microbatches(layout.pp)
        if batch_size % micro:
            raise ValueError(
                f"ParallelConfig.microbatches={micro} must divide the per-rank batch_size={batch_size}"
            )
        if self.schedule == PipelineSchedule.ONE_F_ONE_B and micro < layout.pp:
            raise ValueError(
                f"ParallelConfig.microbatches={micro} must be >= pp={layout.pp} for 1f1b"
            )
        if self.schedule == PipelineSchedule.INTERLEAVED_1F1B:
            rounds = max(1, micro // layout.pp)
            if micro % rounds:
                raise ValueError(
                    f"ParallelConfig.microbatches={micro} must be a multiple of "
                    f"max(1, microbatches // pp)={rounds} for interleaved_1f1b"
                )


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh's data-parallel axis (the whole mesh when it is 1-D and unnamed)."""
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError("an unnamed mesh must be 1-D to be used for data parallelism")
        return mesh
    return mesh[MeshAxis.DP.value]


def _has_own_params(module: nn.Module) -> bool:
    # Parameters outside ``layers`` (embedding, final norm, head) belong to the
    # root group; a middle pipeline stage has none, and then FSDP2 has no root
    # group to reduce and never calls its hook.
    return any(not name.startswith("layers.") for name, _ in module.named_parameters())


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> list[FSDPModule]:
    """Shard ``model`` with FSDP2: one group per entry of ``model.layers``, then the root.

    Args:
        model: a module with a ``layers`` ``ModuleDict`` (see ``Transformer``), or a
            pipeline stage of one.
        mesh: the site mesh; its ``dp`` axis shards the parameters.
        mp_policy: optional mixed precision. Its ``reduce_dtype`` must be fp32 (or
            equal to the parameters' dtype) for a ``GradientSync`` to work: FSDP2
            casts the reduced shard back to the parameter dtype right after the
            all-reduce hook, and an in-place update made later would be lost.
        reshard_after_forward: free gathered parameters after forward. ``False``
            with pipeline parallelism, where each micro-batch would gather them again.

    Returns:
        The FSDP groups that hold parameters, in a fixed order -- layers in index
        order, then the root if it holds the embedding, final norm or head --
        the same on every rank that holds the same layers, so group ``i`` names
        the same parameters on every site.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("apply_fsdp needs a model whose .layers is an nn.ModuleDict")
    kwargs = {"mesh": dp_mesh(mesh)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    groups: list[FSDPModule] = []
    blocks = list(layers.values())
    for i, layer in enumerate(blocks):
        # The last layer is the first one backward needs: resharding it after
        # forward would only all-gather it again immediately (torchtitan does the same).
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
        groups.append(layer)
    # The root keeps its parameters unsharded after forward (FSDP2's root heuristic).
    fully_shard(model, **kwargs)
    if _has_own_params(model):
        groups.append(model)
    return groups


def parallelize(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> list[FSDPModule]:
    """Apply TP, activation checkpointing, compile and FSDP2 to one model part, in place.

    Args:
        model: a ``Transformer`` or one pipeline stage of it, on CPU in fp32.
        mesh: the site mesh from ``build_site_mesh``.
        config: the techniques to apply.

    Returns:
        The part's FSDP groups (see ``apply_fsdp``).
    """
    names = mesh.mesh_dim_names or ()
    if MeshAxis.TP.value in names and mesh[MeshAxis.TP.value].size() > 1:
        apply_tp(model, mesh[MeshAxis.TP.value], sequence_parallel=config.sequence_parallel)
    for block in model.layers.values():
        block.checkpoint = config.activation_checkpoint
        if config.compile:
            # Per block, not the whole model: FSDP2 hooks stay outside the graph
            # and the one compiled graph is reused by every block.
            block.compile()
    mp_policy = None
    if config.mixed_precision:
        # reduce_dtype stays fp32 = the sharded parameters' dtype: FSDP2 then
        # averages inside the collective (ReduceOp.AVG) before the hook and
        # the sharded grads alias the hook's shard (see apply_fsdp).
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pp = mesh[MeshAxis.PP.value].size() if MeshAxis.PP.value in names else 1
    return apply_fsdp(model, mesh, mp_policy=mp_policy, reshard_after_forward=pp == 1)
