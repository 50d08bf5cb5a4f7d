"""What a rank's state carries beside its trainer's: the lane's codec residuals, the
DiLoCo outer optimizer's anchor and momentum, and the sites' split of the batch when it
is balanced.

The same entries travel in a checkpoint (``extra`` of ``intra.checkpoint.save``) and in
the state a joining site pulls from a live peer (``extra/`` of ``intra.state``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from isthmus.deploy.batch.plan import BatchPlan
    from isthmus.inter.data import LaneGradientSync
    from isthmus.intra.outer import OuterOptimizer

CODEC = "codec/"


def extra_state(
    sync: LaneGradientSync | None, outer: OuterOptimizer | None, plan: BatchPlan | None = None
) -> dict[str, torch.Tensor]:
    """The rank's extra entries: ``codec/...`` residuals, ``outer/...`` state and the
    ``batch/...`` size and split."""
    out = {CODEC + k: v for k, v in sync.state_dict().items()} if sync is not None else {}
    if outer is not None:
        out.update(outer.state_dict())
    if plan is not None:
        out.update(plan.state())
    return out


def load_extra_state(
    extra: Mapping[str, torch.Tensor],
    sync: LaneGradientSync | None,
    outer: OuterOptimizer | None,
    plan: BatchPlan | None = None,
) -> None:
    """Give the sync its codec residuals, the outer optimizer its state and the
    batch plan its size and split (a kind missing from ``extra`` starts afresh). ``sync``
    is None when the ``codec/`` entries must not be used: they belong to another site's
    lane, or the job has one site."""
    if sync is not None:
        sync.load_state_dict({k[len(CODEC) :]: v for k, v in extra.items() if k.startswith(CODEC)})
    if outer is not None:
        outer.load_state_dict(extra)
    if plan is not None:
        plan.load_state(extra)
