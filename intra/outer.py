"""DiLoCo's outer optimizer: sites train alone for H steps, then average how far they moved.

Per-step sync (``Trainer(sync=...)``) averages every gradient across sites, so the WAN
carries the whole gradient every step. DiLoCo (Douillard et al. 2023, arXiv 2311.08105)
lets each site take H ordinary steps with its own inner optimizer (AdamW here, any
pp x dp x tp inside the site) on its own data, and only then crosses the WAN once: the
*outer gradient* -- the parameters at the last sync (the anchor) minus the current ones,
in fp32 -- is averaged over the sites through the same ``GradientSync`` seam and codecs
as a gradient, and an outer SGD with Nesterov momentum moves the anchor by it. Every site
then continues from the new anchor, so the replicas are bitwise equal after every outer
step: the averaged outer gradient is (the all-reduce's invariant), and so are the
anchors and the momentum that start equal and take the same updates.

The outer step works on this rank's local shards only, in groups that follow the
model's blocks (each block's parameters, then the parameters outside ``layers``), the
same at every site for the rank at one mesh coordinate: the peer it exchanges with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .train import GradientSync, Trainer

__all__ = ["OuterConfig", "OuterOptimizer", "outer_groups"]

PREFIX = "outer/"


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """The outer loop of DiLoCo. Defaults are the papers' (DiLoCo, INTELLECT-1)."""

    inner_steps: int = 50
    """H: steps each site trains alone between two outer steps."""
    lr: float = 0.7
    """Outer learning rate (1.0 with momentum 0 averages the sites' parameters)."""
    momentum: float = 0.9
    """Nesterov momentum of the outer SGD; 0 disables it."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"OuterConfig.inner_steps must be >= 1, got {self.inner_steps}")
        if not self.lr > 0:
            raise ValueError(f"OuterConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"OuterConfig.momentum must be in [0, 1), got {self.momentum}")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def outer_groups(trainer: Trainer) -> list[list[tuple[str, torch.Tensor]]]:
    """This rank's local parameter shards in sync groups: each block, then the rest.

    Model part by model part (pipeline stages in order), each entry of ``layers`` in
    index order, then the part's parameters outside ``layers`` (embedding, final norm,
    head). Groups without elements on this rank are left out; the rank at the same
    coordinate of every site holds the same shards, so its groups are the same.
    """
    groups: list[list[tuple[str, torch.Tensor]]] = []
    for part in trainer.model_parts:
        layers: nn.ModuleDict = part.layers  # type: ignore[assignment]
        for key, block in layers.items():
            groups.append(
                [(f"layers.{key}.{fqn}", _local(p)) for fqn, p in block.named_parameters()]
            )
        groups.append(
            [
                (fqn, _local(p))
                for fqn, p in part.named_parameters()
                if not fqn.startswith("layers.")
            ]
        )
    return [g for g in groups if sum(t.numel() for _, t in g) > 0]


def _flat(group: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for _, t in group])


class OuterOptimizer:
    """Keeps the anchor and outer momentum of one rank's shards; runs the outer step.

    Args:
        trainer: the rank's trainer, built *without* a sync (its steps stay in the site).
        sync: the cross-site average of one flat fp32 tensor per group (the lane's
            ``LaneGradientSync`` in a job).
        config: H, outer learning rate and momentum.
        total_steps: the job's steps; the last one always ends with an outer step,
            so a job ends with equal replicas.

    Memory: two fp32 copies of the rank's shards (anchor and momentum), as in DiLoCo.
    """

    def __init__(
        self, trainer: Trainer, sync: GradientSync, config: OuterConfig, *, total_steps: int
    ) -> None:
        if trainer.sync is not None:
            raise ValueError("the trainer must not sync gradients itself in DiLoCo mode")
        self.sync, self.config, self.total_steps = sync, config, total_steps
        self.groups = outer_groups(trainer)
        self.anchor = [_flat(g) for g in self.groups]
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        self.outer_steps = 0
        """Outer steps taken by this optimizer (since it was built or loaded)."""

    def due(self, step: int) -> bool:
        """Whether ``step`` ends with an outer step: every H steps, and the job's last."""
        return (step + 1) % self.config.inner_steps == 0 or step == self.total_steps - 1

    @torch.no_grad()
    def step(self) -> None:
        """Averages the outer gradient over the sites and moves the anchor and the
        parameters to the new anchor. Call between inner steps, on every rank.

        Raises:
            Whatever ``sync.finish()`` raises; the anchor, momentum and parameters are
            then unchanged.
        """
        deltas = []
        for i, (group, anchor) in enumerate(zip(self.groups, self.anchor, strict=True)):
            delta = anchor - _flat(group)  # how far this site moved since the last sync
            self.sync.start(i, delta)
            deltas.append(delta)
        self.sync.finish()  # each delta now holds the mean over the sites
        lr, mu = self.config.lr, self.config.momentum
        for group, anchor, buf, delta in zip(
            self.groups, self.anchor, self.momentum, deltas, strict=True
        ):
            # torch.optim.SGD(nesterov=True) on the anchor: buf = mu*buf + g, step g + mu*buf.
            if mu:
                buf.mul_(mu).add_(delta)
                delta.add_(buf, alpha=mu)
            anchor.add_(delta, alpha=-lr)
            self._write(group, anchor)
        self.outer_steps += 1

    @staticmethod
    def _write(group: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
        offset = 0
        for _, t in group:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Anchor and momentum per group, as ``outer/anchor/<i>`` and ``outer/momentum/<i>``
        (the names a rank's state carries in ``extra``)."""
        out = {}
        for i, (anchor, buf) in enumerate(zip(self.anchor, self.momentum, strict=True)):
            out[f"{PREFIX}anchor/{i}"] = anchor
            out[f"{PREFIX}momentum/{i}"] = buf
        return out

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Restores what :meth:`state_dict` returned (other keys are ignored).

        Without any ``outer/`` entry (a state saved in per-step mode) the outer loop
        starts afresh: anchor = the current parameters, momentum zero.

        Returns:
            Whether outer state was found and loaded.

        Raises:
            ValueError: an entry is missing or has the wrong shape; nothing changed then.
        """
        if not any(k.startswith(PREFIX) for k in state):
            self.reset()
            return False
        for name, mine in self.state_dict().items():
            theirs = state.get(name)
            if theirs is None or tuple(theirs.shape) != tuple(mine.shape):
                got = "missing" if theirs is None else f"shape {tuple(theirs.shape)}"
                raise ValueError(f"outer state {name!r}: {got}, expected {tuple(mine.shape)}")
        for name, mine in self.state_dict().items():
            mine.copy_(state[name])
        return True

    @torch.no_grad()
    def reset(self) -> None:
        """Anchor at the current parameters, zero momentum (a fresh outer loop)."""
        for group, anchor, buf in zip(self.groups, self.anchor, self.momentum, strict=True):
            anchor.copy_(_flat(group))
            buf.zero_()
