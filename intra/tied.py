"""A head tied to the embedding across pipeline stages: two copies of one weight, kept
bitwise equal by summing their gradients over the end stages' ranks (docs/one-site.md,
"A tied head across pipeline stages").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .digest import local_shard
from .layout import MeshAxis

EMBEDDING = "tok_embeddings.weight"
"""The tied weight's name on the first stage, and its one name in checkpoints."""
HEAD_COPY = "output.weight"
"""Its copy's name on the last stage."""


def embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The two-rank group of this rank's first and last pipeline stage (same dp, cp and
    tp coordinate), or None on a middle stage's rank. A collective over the site: every
    rank creates every pair's group, in one order."""
    names = list(mesh.mesh_dim_names or ())
    # The mesh's rank grid as (pp, rest): column j is one (dp, cp, tp) coordinate.
    grid = mesh.mesh.permute(
        names.index(MeshAxis.PP.value), *(i for i, n in enumerate(names) if n != MeshAxis.PP.value)
    )
    pairs = grid.reshape(grid.shape[0], -1)
    me, mine = dist.get_rank(), None
    for first, last in zip(pairs[0].tolist(), pairs[-1].tolist(), strict=True):
        group = dist.new_group([first, last])
        if me in (first, last):
            mine = group
    return mine


class TiedEmbedding:
    """This rank's copy of a weight tied across pipeline stages (the head's on the last
    stage, ``is_head``), and the two-rank group of the first and the last stage, whose
    collectives run on ``device``."""

    def __init__(
        self, weight: nn.Parameter, group: dist.ProcessGroup, *, is_head: bool, device: torch.device
    ) -> None:
        self.weight, self.group, self.is_head, self.device = weight, group, is_head, device

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Replace both copies' gradients by their sum (a collective of the two ranks):
        the gradient of the one tied weight. Call after the cross-site sync committed
        (each copy's gradient is then the mean over the sites, the same at every site,
        so their sum is too) and before the gradient is clipped."""
        grad = self.weight.grad
        local = local_shard(self.weight if grad is None else grad)
        buf = self._summed(local if grad is not None else torch.zeros_like(local))
        if grad is None:
            raise RuntimeError("a tied weight's copy got no gradient in backward")
        if buf is not local:
            local.copy_(buf)

    @torch.no_grad()
    def average(self, values: torch.Tensor) -> None:
        """Replace ``values`` (elementwise over this rank's local shard of the copy) by
        the mean of both copies' values, in place: one result for both copies, bit for
        bit (a + b is b + a). The outer modes' averaged outer gradient goes through
        here, as a lossy codec may round the two copies' rows apart (they sit at other
        offsets of their stages' flat groups, so in other chunks)."""
        buf = self._summed(values).div_(2)
        if buf is not values:
            values.copy_(buf)

    def _summed(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the two ranks, in place where it is on ``device``: an
        offloaded gradient lives in host memory, and NCCL reduces device tensors only."""
        buf = t if t.device.type == self.device.type else t.to(self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return buf


def tied_embedding(
    parts: Sequence[nn.Module], mesh: DeviceMesh, device: torch.device
) -> TiedEmbedding | None:
    """This rank's share of a head tied across stages, or None: no tie, ``pp == 1``
    (the head then is the embedding's very parameter), or a middle stage's rank. A
    collective over the site whenever the model is tied and ``pp > 1``."""
    cfg = getattr(parts[0], "cfg", None)
    names = mesh.mesh_dim_names or ()
    if not getattr(cfg, "tie_embeddings", False) or MeshAxis.PP.value not in names:
        return None
    if mesh[MeshAxis.PP.value].size() == 1:
        return None
    group = embedding_group(mesh)
    for part in parts:
        params = dict(part.named_parameters())
        if EMBEDDING in params and HEAD_COPY not in params:
            copy, is_head = params[EMBEDDING], False
        elif HEAD_COPY in params and EMBEDDING not in params:
            copy, is_head = params[HEAD_COPY], True
        else:
            continue
        assert group is not None, "a first or last stage's rank is in an embedding group"
        return TiedEmbedding(copy, group, is_head=is_head, device=device)
    return None


def checkpoint_name(tied: TiedEmbedding | None, fqn: str, param: torch.Tensor) -> str:
    """The name ``param`` (named ``fqn`` on this rank) has in checkpoints: the head's
    copy of a tied weight is the embedding's."""
    if tied is not None and tied.is_head and param is tied.weight:
        return EMBEDDING
    return fqn
