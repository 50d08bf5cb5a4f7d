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

With ``delay`` D > 0 (overlapped or "eager" DiLoCo) a round runs behind the next D inner
steps and lands as the new anchor plus the progress the site made meanwhile: the link
costs nothing while a round is shorter than D steps of compute. The anchors are then
equal whenever a round lands, the parameters at the end (the last round lands at once).

The outer step works on this rank's local shards only, in groups that follow the
model's blocks (each block's parameters, then the parameters outside ``layers``), the
same at every site for the rank at one mesh coordinate: the peer it exchanges with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
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
    delay: int = 0
    """Inner steps the outer all-reduce runs behind (0 <= delay < inner_steps): the
    sites train on while their outer gradients cross, and the average lands ``delay``
    steps after it was taken, added under the progress made meanwhile (overlapped,
    "eager" DiLoCo). 0: each outer step waits for its all-reduce."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"OuterConfig.inner_steps must be >= 1, got {self.inner_steps}")
        if not 0 <= self.delay < self.inner_steps:
            raise ValueError(
                f"OuterConfig.delay must be in [0, inner_steps={self.inner_steps}), "
                f"got {self.delay}"
            )
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


@dataclass(slots=True)
class _Round:
    """An outer all-reduce in flight."""

    step: int
    """The step after which its outer gradients were taken (the lane's round key)."""
    deltas: list[torch.Tensor]
    """The outer gradients handed to the sync; they hold the mean once it finished."""
    taken: list[torch.Tensor] | None
    """With a delay: copies of this site's own outer gradients (anchor - parameters
    when they were taken), to tell the progress made since."""


class OuterOptimizer:
    """Keeps the anchor and outer momentum of one rank's shards; runs the outer steps.

    Args:
        trainer: the rank's trainer, built *without* a sync (its steps stay in the site).
        sync: the cross-site average of one flat fp32 tensor per group (the lane's
            ``LaneGradientSync`` in a job).
        config: H, outer learning rate and momentum, delay.
        total_steps: the job's steps; the last one always ends with an outer step that
            waits for its all-reduce, so a job ends with equal replicas.
        begin_step: called with the step before a round starts (the lane's
            ``begin_step``, which keys the round), or None.

    Memory: two fp32 copies of the rank's shards (anchor and momentum), as in DiLoCo,
    plus one while a round is in flight and one more with a delay.
    """

    def __init__(
        self,
        trainer: Trainer,
        sync: GradientSync,
        config: OuterConfig,
        *,
        total_steps: int,
        begin_step: Callable[[int], None] | None = None,
    ) -> None:
        if trainer.sync is not None:
            raise ValueError("the trainer must not sync gradients itself in DiLoCo mode")
        self.sync, self.config, self.total_steps = sync, config, total_steps
        self.begin_step = begin_step
        self.groups = outer_groups(trainer)
        self.anchor = [_flat(g) for g in self.groups]
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        self.outer_steps = 0
        """Outer steps applied by this optimizer (since it was built or loaded)."""
        self._round: _Round | None = None

    @property
    def in_flight(self) -> bool:
        """An outer all-reduce was started and has not landed yet."""
        return self._round is not None

    def due(self, step: int) -> bool:
        """Whether an outer round starts after ``step``: every H steps, and the last."""
        return (step + 1) % self.config.inner_steps == 0 or step == self.total_steps - 1

    def lands(self, step: int) -> bool:
        """Whether the round in flight must land after ``step`` (its delay is over, or
        a new round or the job's end comes)."""
        r = self._round
        return r is not None and (step >= r.step + self.config.delay or self.due(step))

    @torch.no_grad()
    def step(self, step: int) -> bool:
        """Whatever ``step`` owes the outer loop: land the round in flight when it is
        due, start a new round when one is due (and wait for it without a delay, or at
        the job's last step). Call after every inner step, on every rank.

        Returns:
            Whether a round landed: the anchors are then equal at every site, and so
            are the parameters when nothing is in flight and no delay applies.

        Raises:
            Whatever ``sync.finish()`` raises; the anchor, momentum and parameters are
            then unchanged.
        """
        landed = False
        if self.lands(step):
            self.finish()
            landed = True
        if self.due(step):
            self.start(step)
            if self.config.delay == 0 or step == self.total_steps - 1:
                self.finish()
                landed = True
        return landed

    @torch.no_grad()
    def start(self, step: int) -> None:
        """Hands this site's outer gradient (anchor - parameters) to the sync."""
        if self._round is not None:
            raise RuntimeError(f"outer round of step {self._round.step} still in flight")
        if self.begin_step is not None:
            self.begin_step(step)
        # How far this site moved since the last sync.
        deltas = [anchor - _flat(g) for g, anchor in zip(self.groups, self.anchor, strict=True)]
        taken = [d.clone() for d in deltas] if self.config.delay else None
        for i, delta in enumerate(deltas):
            self.sync.start(i, delta)
        self._round = _Round(step, deltas, taken)

    @torch.no_grad()
    def finish(self) -> None:
        """Waits for the round in flight and applies it: Nesterov SGD on the anchor,
        then the parameters = the new anchor (+ the progress made since the round
        started, with a delay)."""
        r = self._round
        if r is None:
            return
        self.sync.finish()  # each delta now holds the mean over the sites
        self._round = None
        lr, mu = self.config.lr, self.config.momentum
        taken = r.taken or [None] * len(r.deltas)
        for group, anchor, buf, delta, own in zip(
            self.groups, self.anchor, self.momentum, r.deltas, taken, strict=True
        ):
            # Progress since the round started: now - (anchor - own outer gradient).
            progress = None if own is None else _flat(group).sub_(anchor).add_(own)
            # torch.optim.SGD(nesterov=True) on the anchor: buf = mu*buf + g, step g + mu*buf.
            if mu:
                buf.mul_(mu).add_(delta)
                delta.add_(buf, alpha=mu)
            anchor.add_(delta, alpha=-lr)
            self._write(group, anchor if progress is None else progress.add_(anchor))
        self.outer_steps += 1

    def anchor_digest(self) -> str:
        """sha256 over the site's anchors (a collective of the site's process group):
        equal at every site after a round landed, though parameters differ with a delay."""
        h = hashlib.sha256()
        for anchor in self.anchor:
            h.update(anchor.detach().cpu().numpy().tobytes())
        ranks: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, h.hexdigest())
        return hashlib.sha256("".join(str(r) for r in ranks).encode()).hexdigest()

    @staticmethod
    def _write(group: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
        offset = 0
        for _, t in group:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Anchor and momentum per group, as ``outer/anchor/<i>`` and ``outer/momentum/<i>``
        (the names a rank's state carries in ``extra``). Not while a round is in flight
        (``finish`` it first): its outer gradients are in no state."""
        if self._round is not None:
            raise RuntimeError(f"outer round of step {self._round.step} in flight: finish it first")
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
        self._round = None  # a loaded state replaces whatever was in flight
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
        self._round = None
        for group, anchor, buf in zip(self.groups, self.anchor, self.momentum, strict=True):
            anchor.copy_(_flat(group))
            buf.zero_()
