"""A digest of the full parameters, equal for equal weights whatever the sharding."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

_M = TypeVar("_M", bound=nn.Module)  # so a list of Transformers is accepted (list is invariant)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def parameter_digest(model: _M | list[_M], pp_group: dist.ProcessGroup | None = None) -> str:
    """sha256 over the full parameters of a module or this rank's model parts, in
    ``named_parameters()`` order: a collective of the site (DTensors are gathered). With
    ``pp_group``, sha256 over the stages' digests in pp-rank order (equal for equal
    weights under the same layout, not to the unsplit model's digest)."""
    parts = model if isinstance(model, list) else [model]
    h = _hash_parameters(parts, lambda p: p.full_tensor() if isinstance(p, DTensor) else p)
    if pp_group is None:
        return h.hexdigest()
    stage_digests: list[str | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stage_digests, h.hexdigest(), group=pp_group)
    # all_gather_object filled every entry with a stage's hex digest.
    return hashlib.sha256("".join(cast("list[str]", stage_digests)).encode()).hexdigest()


@torch.no_grad()
def shard_digest(parts: Sequence[nn.Module]) -> str:
    """sha256 of this rank's own parameter shards over its stages (no communication):
    equal at equal mesh coordinates of sites that hold the same parameters."""
    return _hash_parameters(parts, local_shard).hexdigest()


def _hash_parameters(parts: Sequence[nn.Module], view: Callable[[torch.Tensor], torch.Tensor]):
    # Name and shape, then fp32 contiguous CPU bytes, parameter by parameter.
    h = hashlib.sha256()
    for part in parts:
        for name, p in part.named_parameters():
            t = view(p).detach().to(device="cpu", dtype=torch.float32).contiguous()
            h.update(f"{name}:{tuple(t.shape)}\n".encode())
            h.update(t.numpy().tobytes())
    return h


def model_layout(parts: Sequence[nn.Module]) -> str:
    """One line per parameter, "name shape dtype" (full shapes of sharded ones), in
    ``named_parameters()`` order: what sites compare before step 0, so that models that
    differ are named by their first differing parameter, not by digests alone."""
    return "\n".join(
        f"{name} {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
        for part in parts
        for name, p in part.named_parameters()
    )
