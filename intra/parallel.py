"""How one site parallelizes a model part: ``parallelize``.

Order of application on each model part (torchtitan's order): tensor parallelism
(DTensor plans over ``tp``), activation checkpointing, ``torch.compile`` per
block, then FSDP2 over ``dp`` -- 2-D with TP, since the TP parameters are
already DTensors on the ``tp`` axis of the same mesh. Pipeline stages are cut
before any of this (``pipeline.py``) and each stage is parallelized on its own.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from .context_parallel import ContextShard
from .layout import MeshAxis, ParallelConfig
from .model import Block, Transformer
from .moe import ExpertShard, MoEFeedForward
from .tensor_parallel import apply_tp


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: the data-parallel axis, flattened with the
    context-parallel one when ``cp > 1`` (cp ranks hold the same parameters and
    average their gradients like replicas); the whole mesh when it is 1-D and unnamed."""
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError("an unnamed mesh must be 1-D to be used for data parallelism")
        return mesh
    if MeshAxis.CP.value in names and mesh[MeshAxis.CP.value].size() > 1:
        return mesh[MeshAxis.DP.value, MeshAxis.CP.value]._flatten("dp_cp")
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
    offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Shard ``model`` (with a ``layers`` ModuleDict: a ``Transformer`` or a pipeline stage
    of one) over the mesh's ``dp`` axis with FSDP2: one group per layer, then the root.

    ``mp_policy``'s ``reduce_dtype`` must be the parameters' (fp32) for a ``GradientSync``
    to work: FSDP2 casts the reduced shard to the parameter dtype right after the
    all-reduce hook, and an in-place update made later would be lost.
    ``reshard_after_forward`` is off with pipeline parallelism, where each micro-batch
    would gather again. ``offload``: FSDP2's ``CPUOffloadPolicy`` (pinned on CUDA). With
    ``expert_mesh`` (``expert_parallel_mesh``) each block's experts are a group of their
    own, just before the block's, sharded over its ``expert_dp`` axis.

    Returns the groups that hold parameters in a fixed order -- layers in index order,
    then the root if it holds the embedding, final norm or head -- so group ``i`` names
    the same parameters at every site's rank that holds the same layers.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError("apply_fsdp needs a model whose .layers is an nn.ModuleDict")
    kwargs: dict[str, Any] = {"mesh": dp_mesh(mesh)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    groups: list[FSDPModule] = []
    blocks = list(layers.values())
    for i, layer in enumerate(blocks):
        # The last layer is the first one backward needs: resharding it after
        # forward would only all-gather it again immediately (torchtitan does the same).
        reshard = reshard_after_forward and i < len(blocks) - 1
        experts = getattr(getattr(layer, "feed_forward", None), "experts", None)
        if expert_mesh is not None and experts is not None:
            outer = expert_mesh["expert_dp"]
            fully_shard(experts, reshard_after_forward=reshard, **(kwargs | {"mesh": outer}))
            groups.append(cast(FSDPModule, experts))
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
        groups.append(cast(FSDPModule, layer))  # fully_shard changed its class in place
    # The root keeps its parameters unsharded after forward (FSDP2's root heuristic).
    fully_shard(model, **kwargs)
    if _has_own_params(model):
        groups.append(cast(FSDPModule, model))
    return groups


def context_shard(mesh: DeviceMesh) -> ContextShard | None:
    """This rank's context-parallel group, or None when the mesh has no cp axis > 1."""
    names = mesh.mesh_dim_names or ()
    if MeshAxis.CP.value not in names or mesh[MeshAxis.CP.value].size() == 1:
        return None
    cp_mesh = mesh[MeshAxis.CP.value]
    return ContextShard(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    config: ParallelConfig,
    *,
    expert_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Apply TP, context parallelism, activation checkpointing, compile and FSDP2 to
    one model part (CPU, fp32), in place; returns its FSDP groups (``apply_fsdp``).
    ``expert_mesh``: the site's ``expert_parallel_mesh``, shared by its pipeline stages
    (made here if not given)."""
    names = mesh.mesh_dim_names or ()
    if MeshAxis.TP.value in names and mesh[MeshAxis.TP.value].size() > 1:
        apply_tp(model, mesh[MeshAxis.TP.value], sequence_parallel=config.sequence_parallel)
    context = context_shard(mesh)
    if context is not None:
        model.context = context
    for block in model.layers.values():
        assert isinstance(block, Block)  # what Transformer.layers holds
        if context is not None:
            block.attention.context = context
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
    if config.expert_parallel > 1:
        if expert_mesh is None:
            expert_mesh = expert_parallel_mesh(mesh, config.expert_parallel)
        _split_experts(model, expert_mesh["ep"])
    pp = mesh[MeshAxis.PP.value].size() if MeshAxis.PP.value in names else 1
    return apply_fsdp(
        model,
        mesh,
        mp_policy=mp_policy,
        reshard_after_forward=pp == 1,
        offload=config.offload,
        expert_mesh=expert_mesh if config.expert_parallel > 1 else None,
    )


def expert_parallel_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """A second mesh over the site's ranks with the dp axis split as ``(ep, dp_outer)``:
    rank order is the site mesh's, so dp rank ``d`` sits at ``ep = d // (dp / ep)``,
    ``dp_outer = d % (dp / ep)``. Experts are split over ``ep``; the ranks holding the
    same experts -- ``dp_outer`` and ``cp``, adjacent, flattened as ``expert_dp`` --
    shard and average them."""
    pp, dp, cp, tp = (mesh[axis.value].size() for axis in MeshAxis)
    experts = init_device_mesh(
        mesh.device_type,
        (pp, ep, dp // ep, cp, tp),
        mesh_dim_names=("pp", "ep", "dp_outer", "cp", "tp"),
    )
    experts["dp_outer", "cp"]._flatten("expert_dp")
    return experts


def _split_experts(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Give each rank of ``ep_mesh`` its slice of every expert layer's experts (a
    DTensor sharded on the expert dimension) and tell the layer where they are."""
    shard = ExpertShard(ep_mesh.get_group(), ep_mesh.get_local_rank(), ep_mesh.size())
    for module in model.modules():
        if not isinstance(module, MoEFeedForward):
            continue
        module.expert_shard = shard
        module.experts.grad_scale = 1.0 / shard.size
        for name, param in list(module.experts.named_parameters()):
            split = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            module.experts.register_parameter(name, nn.Parameter(split))


def group_parameters(group: FSDPModule) -> list[nn.Parameter]:
    """The parameters one FSDP group shards, in registration order: its module's, less
    those of the groups nested in it -- for the root (the model or a pipeline stage)
    the embedding, final norm and head."""
    module = cast(nn.Module, group)
    # A nested group's parameters are its own (a block's experts under expert
    # parallelism; the blocks under the root).
    nested = {
        id(p)
        for sub in module.modules()
        if sub is not module and isinstance(sub, FSDPModule)
        for p in sub.parameters()
    }
    return [p for p in module.parameters() if id(p) not in nested]


def sharded_rows(module: nn.Module) -> dict[int, tuple[int, int, int, int]]:
    """How FSDP2 sharded each parameter under ``module``, by ``id(parameter)``: ``(rows,
    row_elems, shard_index, shard_width)``, the first dimension's rows before FSDP (after
    TP), the elements per row, and this rank's chunk (torch.chunk's rule) of how many.
    Sites of different sizes pair their ranks by these (inter/data/sync/shard_map.py);
    FSDP2's own record of each parameter follows whatever it padded."""
    out: dict[int, tuple[int, int, int, int]] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        # torch 2.13 keeps a list of parameter groups per module, 2.11 one.
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g] if (g := getattr(state, "_fsdp_param_group", None)) else []
        for group in groups:
            for fp in group.fsdp_params:
                if fp.fsdp_placement != Shard(0):
                    raise ValueError(f"FSDP sharded a parameter on {fp.fsdp_placement}, not dim 0")
                size, info = fp._orig_size, fp.mesh_info
                row_elems = math.prod(size[1:])
                out[id(fp.sharded_param)] = (
                    size[0],
                    row_elems,
                    info.shard_mesh_rank,
                    info.shard_mesh_size,
                )
    return out
