"""DiLoCo's outer optimizer: sites train alone for H steps, then average how far they moved.

docs/sync-modes.md says the modes (DiLoCo, its delay and merges, Streaming DiLoCo's
fragments). The outer step works on this rank's local shards, in groups that follow the
model's blocks, the same at every site for the rank at one mesh coordinate: its peer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .outer_groups import fragment_of, outer_groups, tied_slice
from .train import GradientSync, SyncResult, Trainer

__all__ = ["OuterConfig", "OuterOptimizer"]

PREFIX = "outer/"

log = logging.getLogger(__name__)


@runtime_checkable
class VotesAhead(Protocol):
    """A sync that can vote on a step's rounds as soon as they end, before ``finish``
    (the lane's ``LaneGradientSync``; one without a membership ignores it)."""

    def vote_ahead(self, step: int) -> None: ...


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """The outer loop of DiLoCo. Defaults are the papers' (DiLoCo, INTELLECT-1)."""

    inner_steps: int = 50
    """H: steps each site trains alone between two outer steps."""
    lr: float = 0.7
    """Outer learning rate (1.0 with momentum 0 averages the sites' parameters)."""
    lr_ramp: float = 1.0
    """The outer learning rate at the end of the inner schedule, as a multiple of
    ``lr``: a round taken at a step where the inner cosine has gone a fraction d of the
    way from its peak to its floor steps with ``lr * (1 + (lr_ramp - 1) * d)``. 1 keeps
    ``lr`` throughout."""
    momentum: float = 0.9
    """Nesterov momentum of the outer SGD; 0 disables it."""
    delay: int = 0
    """Inner steps the outer all-reduce runs behind (0 <= delay < inner_steps/fragments):
    the sites train on while their outer gradients cross, and the average lands
    ``delay`` steps after it was taken, merged with the progress made meanwhile
    (overlapped DiLoCo; see ``alpha``). 0: each outer step waits for its all-reduce."""
    fragments: int = 1
    """P: strided fragments of the blocks, synced in turn (Streaming DiLoCo); 1 = DiLoCo.
    Must divide ``inner_steps``."""
    alpha: float | None = None
    """How a round that lands late meets the local parameters: None adds the progress
    made since it was taken to the new anchor ("eager" DiLoCo); a number mixes,
    ``alpha``·local + (1-``alpha``)·new anchor (Streaming DiLoCo's merge)."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"OuterConfig.inner_steps must be >= 1, got {self.inner_steps}")
        if not 1 <= self.fragments <= self.inner_steps or self.inner_steps % self.fragments:
            raise ValueError(
                f"OuterConfig.fragments must divide inner_steps={self.inner_steps}, "
                f"got {self.fragments}"
            )
        if not 0 <= self.delay < self.period:
            raise ValueError(
                f"OuterConfig.delay must be in [0, inner_steps/fragments={self.period}), "
                f"got {self.delay}"
            )
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ValueError(f"OuterConfig.alpha must be in [0, 1], got {self.alpha}")
        if not self.lr > 0:
            raise ValueError(f"OuterConfig.lr must be > 0, got {self.lr}")
        if not self.lr_ramp > 0:
            raise ValueError(f"OuterConfig.lr_ramp must be > 0, got {self.lr_ramp}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"OuterConfig.momentum must be in [0, 1), got {self.momentum}")

    @property
    def period(self) -> int:
        """Steps between two rounds: H / P (one fragment's round each)."""
        return self.inner_steps // self.fragments


def _flat(group: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for _, t in group])


@dataclass(slots=True)
class _Round:
    """An outer all-reduce in flight."""

    step: int  # after which its outer gradients were taken (the lane's round key)
    groups: list[int]  # the groups it carries (one fragment's, or all at the job's end)
    deltas: list[torch.Tensor]  # the outer gradients; they hold the mean once it finished
    # Eager merge (alpha None) with a delay: copies of this site's own outer gradients
    # (anchor - parameters when taken), to tell the progress since.
    taken: list[torch.Tensor] | None
    # Landing after later inner steps whose progress is kept (a delay and not the job's
    # last step); otherwise the parameters become the new anchor.
    merge: bool


class OuterOptimizer:
    """Keeps the anchor and outer momentum of one rank's shards; runs the outer steps.

    ``trainer`` is built *without* a sync (its steps stay in the site); ``sync`` averages
    one flat fp32 tensor per group across sites. The job's last step (``total_steps - 1``)
    ends with a waited outer step of every fragment, so a job ends with equal replicas.
    """

    def __init__(
        self, trainer: Trainer, sync: GradientSync, config: OuterConfig, *, total_steps: int
    ) -> None:
        if trainer.sync is not None:
            raise ValueError("the trainer must not sync gradients itself in DiLoCo mode")
        self.sync, self.config, self.total_steps = sync, config, total_steps
        self._trainer = trainer
        self.groups = outer_groups(trainer)
        self.fragment = [fragment_of(g, config.fragments) for g in self.groups]
        filled = len(set(self.fragment))
        if config.fragments > 1 and filled < config.fragments:
            blocks = sum(g.block is not None for g in self.groups)
            log.warning(
                "streaming: %d fragments asked for, and the model's %d repeated block(s) "
                "fill %d of them: the others send nothing (give the model a list of "
                "blocks, or fewer sync.fragments)",
                config.fragments,
                blocks,
                filled,
            )
        self.anchor = [_flat(g) for g in self.groups]
        self._tied = tied_slice(trainer, self.groups)  # a head tied across stages
        self.momentum = [torch.zeros_like(a) for a in self.anchor]
        self.outer_steps = 0  # rounds applied since built: (fragment) outer steps
        self._round: _Round | None = None

    @property
    def in_flight(self) -> bool:
        """An outer all-reduce was started and has not landed yet."""
        return self._round is not None

    @property
    def replicas_equal_on_landing(self) -> bool:
        """Whether the parameters (not only the anchors) are equal across sites after a
        round landed: DiLoCo without a delay. Otherwise they are at the job's end."""
        return self.config.delay == 0 and self.config.fragments == 1

    def due(self, step: int) -> bool:
        """Whether a round starts after ``step``: every H/P steps, and the last."""
        return (step + 1) % self.config.period == 0 or step == self.total_steps - 1

    def due_fragments(self, step: int) -> list[int]:
        """The fragments whose round starts after ``step``: fragment k at (k+1)·H/P
        steps into each H, every fragment at the job's last step, none otherwise."""
        cfg = self.config
        if step == self.total_steps - 1:
            return list(range(cfg.fragments))
        if (step + 1) % cfg.period:
            return []
        return [((step + 1) % cfg.inner_steps // cfg.period - 1) % cfg.fragments]

    def lands(self, step: int) -> bool:
        """Whether the round in flight must land after ``step`` (its delay is over, or
        a new round or the job's end comes)."""
        r = self._round
        return r is not None and (step >= r.step + self.config.delay or self.due(step))

    @torch.no_grad()
    def step(self, step: int) -> SyncResult | None:
        """Whatever ``step`` owes the outer loop: land the round in flight when it is
        due, start a new round when one is due (and wait for it without a delay, or at
        the job's last step). Call after every inner step, on every rank.

        Returns what the sync said of the round that landed (None if none did). Committed:
        the anchors are equal at every site, and so are the parameters if
        :attr:`replicas_equal_on_landing` or at the end. Not committed (the job went on
        without this site): nothing changed, the round is still in flight, and the caller
        pulls the live state. Whatever ``sync.finish()`` raises leaves everything as it was.
        """
        landed = None
        if self.lands(step):
            landed = self.finish()
            if landed is not None and not landed.committed:
                return landed
        if self.due(step):
            self.start(step)
            if self._round is not None and not self._round.merge:
                landed = self.finish()
        return landed

    @torch.no_grad()
    def start(self, step: int) -> None:
        """Hands this site's outer gradient (anchor - parameters) of the fragments due
        after ``step`` to the sync (all of them if none is due)."""
        if self._round is not None:
            raise RuntimeError(f"outer round of step {self._round.step} still in flight")
        due = self.due_fragments(step) or list(range(self.config.fragments))
        groups = [i for i, k in enumerate(self.fragment) if k in due]
        merge = self.config.delay > 0 and step != self.total_steps - 1
        # How far this site moved since the last sync.
        deltas = [self.anchor[i] - _flat(self.groups[i]) for i in groups]
        eager = merge and self.config.alpha is None
        taken = [d.clone() for d in deltas] if eager else None
        for i, delta in zip(groups, deltas, strict=True):
            self.sync.start(step, i, delta)
        if merge and isinstance(self.sync, VotesAhead):
            # The round lands `delay` steps from now: vote as soon as it ends, so the
            # landing finds the job's decision made rather than waiting there for the
            # slowest site's vote (its step times drift from this site's meanwhile).
            self.sync.vote_ahead(step)
        self._round = _Round(step, groups, deltas, taken, merge)

    @torch.no_grad()
    def finish(self) -> SyncResult | None:
        """Waits for the round in flight and applies it: Nesterov SGD on the anchor of
        each group it carries, then their parameters = the new anchor, merged with the
        progress made since the round started if it landed late. Returns what the sync
        said (None: no round in flight); a round that did not commit stays in flight."""
        r = self._round
        if r is None:
            return None
        result = self.sync.finish(r.step)  # each delta now holds the mean over the sites
        if not result.committed:
            return result
        self._round = None
        self._average_tied_copies(r)
        lr, mu, alpha = self.lr_at(r.step), self.config.momentum, self.config.alpha
        taken: Sequence[torch.Tensor | None] = r.taken or [None] * len(r.groups)
        for i, delta, own in zip(r.groups, r.deltas, taken, strict=True):
            group, anchor, buf = self.groups[i], self.anchor[i], self.momentum[i]
            # Eager merge: the progress since the round started, now - (anchor - own).
            progress = None if own is None else _flat(group).sub_(anchor).add_(own)
            local = _flat(group) if r.merge and alpha is not None else None
            # torch.optim.SGD(nesterov=True) on the anchor: buf = mu*buf + g, step g + mu*buf.
            if mu:
                buf.mul_(mu).add_(delta)
                delta.add_(buf, alpha=mu)
            anchor.add_(delta, alpha=-lr)
            if progress is not None:
                self._write(group, progress.add_(anchor))
            elif local is not None:  # Streaming DiLoCo: alpha*local + (1-alpha)*anchor
                assert alpha is not None  # local is only taken with alpha set
                self._write(group, local.mul_(alpha).add_(anchor, alpha=1 - alpha))
            else:
                self._write(group, anchor)
        if r.groups:  # a fragment with no groups here moved nothing: not a round
            self.outer_steps += 1
        return result

    def _average_tied_copies(self, r: _Round) -> None:
        """Make the two copies of a weight tied across pipeline stages take one mean
        outer gradient (a collective of the first and last stage's ranks, which land
        the round of their parts outside ``layers`` at the same step): a lossy codec
        rounds the copies' rows in other chunks, so their means may differ by a few
        ulps, and the copies would drift apart."""
        if self._tied is None or self._trainer.tied is None:
            return
        group, offset, count = self._tied
        if group in r.groups:
            delta = r.deltas[r.groups.index(group)]
            self._trainer.tied.average(delta[offset : offset + count])

    def lr_at(self, step: int) -> float:
        """The outer learning rate of a round taken after ``step`` (``OuterConfig.lr_ramp``:
        it follows the inner schedule, the same at every site)."""
        cfg = self.config  # lr_ramp 1: lr * (1.0 + 0.0 * d), which is lr bit for bit
        return cfg.lr * (1.0 + (cfg.lr_ramp - 1.0) * self._trainer.config.decayed_at(step))

    def anchor_digest(self) -> str:
        """``Trainer.parameter_digest`` of the anchors (a collective of the site): equal at
        every site of any size after a round landed, though parameters differ with a delay."""
        with self.shared_model():
            return self._trainer.parameter_digest()

    @contextmanager
    def shared_model(self) -> Iterator[None]:
        """Inside the block, the parameters are the anchors, the model the sites share;
        the local parameters (which drift apart between rounds) come back bit for bit."""
        with torch.no_grad():
            local = [_flat(g) for g in self.groups]
            for group, anchor in zip(self.groups, self.anchor, strict=True):
                self._write(group, anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for group, mine in zip(self.groups, local, strict=True):
                    self._write(group, mine)

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
        """Restores what :meth:`state_dict` returned (other keys are ignored); returns
        whether there was outer state. Without any ``outer/`` entry (a state saved in
        per-step mode) the outer loop starts afresh (``reset``). ValueError, changing
        nothing, when an entry is missing or has the wrong shape."""
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
