"""Sites of different speeds: each step's global batch split so the sites finish together.

The global batch is ``U`` micro-batches of ``train.batch_size`` sequences, numbered
site-major (``intra.data.ShardedBatches``): site ``s`` takes ``m_s`` micro-batches on
each of its ``dp_s`` replicas, its units ``u_s = m_s * dp_s``, and ``sum(u_s) = U``.
``train.accumulate`` sets the first split. With ``train.balance_every = N``, every N
steps each site's rank 0 adds the site's measured seconds per micro-batch to that
step's sync (``LaneGradientSync.share``). Only the step's commit makes the sum visible,
and it is the same bits at every site, so the new split -- a deterministic function of
it (:func:`best_split`) -- is the same everywhere; every rank takes it from its rank 0
and uses it from the next step. ``U`` never changes, and each site's gradient keeps
counting by its units (``set_site_units``), so a step's mean is over the same windows
of tokens whatever the split: only who computes which part moves.

What is measured is what a micro-batch costs the site: the step's compute (forward,
backward, optimizer; not the wait for other sites) over its micro-batches, the median
over the steps since the last decision. A decision that would shorten the slowest
site's predicted step by less than :data:`GAIN` is not taken, so measurement noise does
not move micro-batches back and forth.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from isthmus.inter.data.codecs.int8 import BLOCK

if TYPE_CHECKING:
    from isthmus.inter.data.gradient_sync import LaneGradientSync
    from isthmus.intra.data import ShardedBatches
    from isthmus.intra.train import Trainer

__all__ = ["GAIN", "BALANCE_KEY", "Balancer", "BatchSplit", "best_split"]

log = logging.getLogger("isthmus.balance")

GAIN = 0.1
"""A new split must shorten the predicted step by more than this fraction."""

BALANCE_KEY = "balance/accumulate"
"""The split's entry in a rank's extra state (checkpoints, and the state a joiner pulls)."""


@dataclass(frozen=True, slots=True)
class BatchSplit:
    """Micro-batches per rank per step at each site, and each site's dp width."""

    accumulate: tuple[int, ...]
    dp: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.accumulate) != len(self.dp) or min(self.accumulate + self.dp) < 1:
            raise ValueError(f"need one count >= 1 per site, got {self.accumulate} x {self.dp}")

    @property
    def units(self) -> list[int]:
        """Each site's micro-batches per step over its replicas (its gradient's weight)."""
        return [m * d for m, d in zip(self.accumulate, self.dp, strict=True)]

    @property
    def total(self) -> int:
        """The global batch in micro-batches."""
        return sum(self.units)

    def first_unit(self, site: int, dp_index: int) -> int:
        """The first of the global batch's micro-batches that replica ``dp_index`` of
        ``site`` takes (it takes ``accumulate[site]`` from there on)."""
        return sum(self.units[:site]) + dp_index * self.accumulate[site]


def best_split(seconds: Sequence[float], split: BatchSplit, gain: float = GAIN) -> BatchSplit:
    """The split that minimizes the slowest site's compute, the global batch held.

    Args:
        seconds: each site's seconds per micro-batch on one replica; 0 (or anything not
            a positive finite number) for a site that did not report, which keeps its
            micro-batches (a dead site, one that just rejoined).
        split: the split in use.
        gain: keep ``split`` unless the best one's predicted step (the largest
            ``m_s * seconds_s``) is shorter than ``split``'s by more than this fraction.

    Returns:
        The new split (``split`` itself when nothing better enough exists). Every site
        computes it from the same bits, so it must not depend on anything else: the
        search is exact (a table over the units), and ties go to the split with the
        fewest micro-batches moved, then to the earlier site keeping fewer.
    """
    if len(seconds) != len(split.accumulate):
        raise ValueError(f"{len(seconds)} timings for {len(split.accumulate)} sites")
    live = [i for i, t in enumerate(seconds) if math.isfinite(t) and t > 0]
    if len(live) < 2:
        return split
    units = split.units
    budget = sum(units[i] for i in live)
    # tables[k][u]: the least possible slowest time of live sites 0..k-1 taking u units.
    table = np.full(budget + 1, math.inf)
    table[0] = 0.0
    tables = [table]
    for i in live:
        nxt = np.full(budget + 1, math.inf)
        for m in range(1, budget // split.dp[i] + 1):
            shift, cost = m * split.dp[i], m * float(seconds[i])
            np.minimum(nxt[shift:], np.maximum(table[: budget + 1 - shift], cost), out=nxt[shift:])
        table = nxt
        tables.append(table)
    best = float(table[budget])
    now = max(split.accumulate[i] * float(seconds[i]) for i in live)
    if not math.isfinite(best) or now <= best * (1 + gain):
        return split
    accumulate = list(split.accumulate)
    left = budget
    for k in range(len(live) - 1, -1, -1):
        i = live[k]
        feasible = [
            m
            for m in range(1, left // split.dp[i] + 1)
            if max(float(tables[k][left - m * split.dp[i]]), m * float(seconds[i])) <= best
        ]
        m = min(feasible, key=lambda m, cur=split.accumulate[i]: (abs(m - cur), m))
        accumulate[i] = m
        left -= m * split.dp[i]
    assert left == 0, (left, accumulate)
    return BatchSplit(tuple(accumulate), split.dp)


class Balancer:
    """One rank's part in re-balancing the split (see the module docstring).

    Call :meth:`before_step` before each step's training, :meth:`after_step` after a
    committed step (before its state is offered or saved). The split applies to the
    rank's batches, its trainer's micro-batches and its sync's site weights.

    Args:
        every: decide every this many steps (> 0).
        split: the split to start with (``train.accumulate``'s).
        site: this site's index among the job's configured sites (its slot).
        sites: the job's site names, in that order.
        dp_index: this rank's replica in its site.
        rank: this rank in its site (rank 0 measures and shares).
        sync, trainer, batches: what the split is applied to.
    """

    def __init__(
        self,
        *,
        every: int,
        split: BatchSplit,
        site: int,
        sites: Sequence[str],
        dp_index: int,
        rank: int,
        sync: LaneGradientSync,
        trainer: Trainer,
        batches: ShardedBatches,
    ) -> None:
        if every < 1:
            raise ValueError(f"balance every must be >= 1, got {every}")
        self.every, self.site, self.sites = every, site, list(sites)
        self.dp_index, self.rank = dp_index, rank
        self.sync, self.trainer, self.batches = sync, trainer, batches
        self.split = split
        self._per_micro: list[float] = []
        self._warm = False  # the first step after a start compiles and allocates: not counted
        # One value per codec block, so a blockwise codec gives each its own scale and
        # none rounds to zero beside a larger one.
        self._shared: torch.Tensor | None = None
        self.apply(split)

    def due(self, step: int) -> bool:
        """Whether ``step``'s sync carries a decision."""
        return (step + 1) % self.every == 0

    def apply(self, split: BatchSplit) -> None:
        """Uses ``split`` from the next step on."""
        if split.dp != self.split.dp or split.total != self.split.total:
            raise ValueError(f"split {split} does not divide the global batch of {self.split}")
        m = split.accumulate[self.site]
        self.batches.resplit(split.first_unit(self.site, self.dp_index), m)
        self.trainer.set_accumulate(m)
        self.sync.set_site_units(dict(zip(self.sites, split.units, strict=True)))
        self.split = split

    def measure(self, compute_s: float) -> None:
        """Counts a step that took ``compute_s`` of the site's own work (with any
        slowdown it suffered), over the micro-batches it ran."""
        if not self._warm:
            self._warm = True
            return
        self._per_micro.append(compute_s / self.split.accumulate[self.site])

    def before_step(self, step: int) -> None:
        """At a due step, rank 0 adds the site's seconds per micro-batch to its sync."""
        if self.rank != 0 or not self.due(step):
            return
        values = torch.zeros(len(self.sites) * BLOCK, dtype=torch.float32)
        if self._per_micro:
            # The median step: one step that stalls (a collection, a page fault, a
            # neighbour's burst) must not move micro-batches.
            values[self.site * BLOCK] = statistics.median(self._per_micro)
        self._shared = values
        self.sync.share(step, values)

    def after_step(self, step: int) -> bool:
        """After a committed step: at a due one, the site's ranks take the split rank 0
        computed from the shared sum (a collective of the site). Returns whether the
        split changed."""
        if not self.due(step):
            return False
        chosen = torch.tensor(self.split.accumulate, dtype=torch.int64)
        seconds: list[float] = []
        if self.rank == 0:
            assert self._shared is not None, "after_step without before_step"
            seconds = self._shared[::BLOCK].tolist()
            chosen = torch.tensor(best_split(seconds, self.split).accumulate, dtype=torch.int64)
        dist.broadcast(chosen, src=0)
        self._per_micro, self._shared = [], None
        split = BatchSplit(tuple(chosen.tolist()), self.split.dp)
        if split == self.split:
            return False
        if self.rank == 0:
            log.warning(
                "step %d: seconds per micro-batch %s; micro-batches per rank %s -> %s",
                step,
                [round(t, 4) for t in seconds],
                list(self.split.accumulate),
                list(split.accumulate),
            )
        self.apply(split)
        return True

    def state(self) -> dict[str, torch.Tensor]:
        """The split in use, for a checkpoint or a joining site."""
        return {BALANCE_KEY: torch.tensor(self.split.accumulate, dtype=torch.int64)}

    def load_state(self, extra: Mapping[str, torch.Tensor]) -> None:
        """Takes the split a checkpoint or a live site's state holds (none: keep this
        one); the measurements start afresh."""
        self._per_micro, self._warm, self._shared = [], False, None
        if BALANCE_KEY in extra:
            self.apply(BatchSplit(tuple(extra[BALANCE_KEY].tolist()), self.split.dp))
