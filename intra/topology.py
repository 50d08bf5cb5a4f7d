"""The site's named device mesh, from its ``ParallelLayout``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .layout import MeshAxis, ParallelLayout


def build_site_mesh(layout: ParallelLayout, device_type: str = "cpu") -> DeviceMesh:
    """The site's 4-D device mesh, axes ``("pp", "dp", "cp", "tp")`` (size-1 ones kept).

    Initializes the default process group from torchrun's environment if the caller has
    not: the site's ranks only (docs/design.md: no communicator spans sites); on ``cuda``
    the rank's device is ``LOCAL_RANK``. Ranks are row-major, ``tp`` innermost, so a TP
    group is ``tp`` consecutive ranks (one NVLink island) and a CP group the next-nearest.
    ValueError on a device type other than ``cpu``/``cuda`` or another world size.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device_type='cuda' was requested but no CUDA device is available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"the site's process group has {world} ranks but the layout needs "
            f"pp*dp*cp*tp={layout.world_size} ({layout})"
        )
    return init_device_mesh(
        device_type,
        (layout.pp, layout.dp, layout.cp, layout.tp),
        mesh_dim_names=tuple(axis.value for axis in MeshAxis),
    )


def mesh_coordinate(mesh: DeviceMesh) -> tuple[int, int, int, int]:
    """This rank's ``(pp, dp, cp, tp)`` coordinate in a mesh from ``build_site_mesh``:
    cross-site lanes pair the ranks at one coordinate (all sites' layouts are equal)."""
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    names = mesh.mesh_dim_names or ()
    return tuple(  # type: ignore[return-value]
        coord[names.index(axis.value)] if axis.value in names else 0 for axis in MeshAxis
    )
