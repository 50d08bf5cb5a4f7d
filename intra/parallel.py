"""Data parallelism inside a site: FSDP2 (``fully_shard``) per transformer layer."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .topology import MeshAxis


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh's data-parallel axis (the whole mesh when it is 1-D and unnamed)."""
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError("an unnamed mesh must be 1-D to be used for data parallelism")
        return mesh
    return mesh[MeshAxis.DP.value]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[FSDPModule]:
    """Shard ``model`` with FSDP2: one group per entry of ``model.layers``, then the root.

    Args:
        model: a module with a ``layers`` ``ModuleList`` (see ``Transformer``).
        mesh: the site mesh; its ``dp`` axis shards the parameters.
        mp_policy: optional mixed precision. Its ``reduce_dtype`` must be fp32 (or
            equal to the parameters' dtype) for a ``GradientSync`` to work: FSDP2
            casts the reduced shard back to the parameter dtype right after the
            all-reduce hook, and an in-place update made later would be lost.

    Returns:
        The FSDP groups in a fixed order -- layer 0, ..., layer L-1, root -- the
        same on every rank and every site, so group ``i`` names the same
        parameters everywhere. The root group holds the embedding, final norm and
        output head.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("apply_fsdp needs a model whose .layers is an nn.ModuleList")
    kwargs = {"mesh": dp_mesh(mesh)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    groups: list[FSDPModule] = []
    for i, layer in enumerate(layers):
        # The last layer is the first one backward needs: resharding it after
        # forward would only all-gather it again immediately (torchtitan does the same).
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
        groups.append(layer)
    # The root keeps its parameters unsharded after forward (FSDP2's root heuristic).
    fully_shard(model, **kwargs)
    groups.append(model)
    return groups
