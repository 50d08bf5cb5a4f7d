"""How each step's global batch is split between the sites, so they finish together.

The global batch is ``U`` micro-batches of ``train.batch_size`` sequences, numbered
site-major (``intra.corpus.batches.ShardedBatches``): site ``s`` takes ``m_s`` micro-batches on
each of its ``dp_s`` replicas, its units ``u_s = m_s * dp_s``, and ``sum(u_s) = U``.
Each site's gradient counts by its units (``LaneGradientSync.set_site_units``), so a
step's mean is over the same windows of tokens whatever the split: only who computes
which part moves.

These are pure functions: every site calls them with the same bits (the measured
timings reach every site as the bits of one committed sum: deploy/batch/plan.py) and
must get the same split, so the search is exact and its ties are broken by rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["GAIN", "BatchSplit", "best_split", "resized"]

GAIN = 0.1
"""A new split must shorten the predicted step by more than this fraction."""


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


def _tables(seconds: Sequence[float], dp: Sequence[int], budget: int) -> list[np.ndarray]:
    """``tables[k][u]``: the least possible slowest time of sites 0..k-1 (of those
    given) taking ``u`` units between them, each at least one micro-batch per replica
    (inf where no split takes exactly ``u``)."""
    table = np.full(budget + 1, math.inf)
    table[0] = 0.0
    tables = [table]
    for t, d in zip(seconds, dp, strict=True):
        nxt = np.full(budget + 1, math.inf)
        for m in range(1, budget // d + 1):
            shift, cost = m * d, m * float(t)
            np.minimum(nxt[shift:], np.maximum(table[: budget + 1 - shift], cost), out=nxt[shift:])
        table = nxt
        tables.append(table)
    return tables


def _pick(
    tables: list[np.ndarray],
    seconds: Sequence[float],
    dp: Sequence[int],
    current: Sequence[int],
    budget: int,
) -> list[int]:
    """The micro-batches per replica of a split reaching ``tables[-1][budget]``, the
    last site decided first; ties go to the count nearest the current one, then to
    the smaller."""
    best = float(tables[-1][budget])
    chosen = list(current)
    left = budget
    for k in range(len(seconds) - 1, -1, -1):
        feasible = [
            m
            for m in range(1, left // dp[k] + 1)
            if max(float(tables[k][left - m * dp[k]]), m * float(seconds[k])) <= best
        ]
        m = _nearest(feasible, current[k])
        chosen[k] = m
        left -= m * dp[k]
    assert left == 0, (left, chosen)
    return chosen


def _nearest(counts: list[int], target: int) -> int:
    """The count of `counts` nearest `target`, the smaller on a tie."""
    return min(counts, key=lambda m: (abs(m - target), m))


def _measured(seconds: Sequence[float]) -> list[int]:
    return [i for i, t in enumerate(seconds) if math.isfinite(t) and t > 0]


def best_split(seconds: Sequence[float], split: BatchSplit, gain: float = GAIN) -> BatchSplit:
    """The split that minimizes the slowest site's compute, the global batch held.

    ``seconds``: each site's per micro-batch on one replica; a site without a positive
    finite figure (dead, or just rejoined) keeps its micro-batches. ``split`` stays unless
    the best one's predicted step (the largest ``m_s * seconds_s``) is shorter by more
    than ``gain``. Every site computes it from the same bits, so it must not depend on
    anything else: the search is exact (a table over the units), and ties go to the split
    with the fewest micro-batches moved, then to the earlier site keeping fewer.
    """
    if len(seconds) != len(split.accumulate):
        raise ValueError(f"{len(seconds)} timings for {len(split.accumulate)} sites")
    live = _measured(seconds)
    if len(live) < 2:
        return split
    budget = sum(split.units[i] for i in live)
    times, dp = [seconds[i] for i in live], [split.dp[i] for i in live]
    tables = _tables(times, dp, budget)
    best = float(tables[-1][budget])
    now = max(split.accumulate[i] * float(seconds[i]) for i in live)
    if not math.isfinite(best) or now <= best * (1 + gain):
        return split
    picked = _pick(tables, times, dp, [split.accumulate[i] for i in live], budget)
    accumulate = list(split.accumulate)
    for i, m in zip(live, picked, strict=True):
        accumulate[i] = m
    return BatchSplit(tuple(accumulate), split.dp)


def resized(
    split: BatchSplit,
    total: int,
    seconds: Sequence[float] = (),
    shares: Sequence[int] | None = None,
) -> BatchSplit:
    """``split`` changed to a global batch of ``total`` micro-batches, or the nearest
    larger one that whole micro-batches per replica can make (sites of dp 2 and 2
    cannot take 7).

    With every site's ``seconds`` measured, the new split is the fastest one
    (:func:`best_split`'s search); otherwise the sites' replicas take micro-batches in
    proportion to ``shares`` (default ``split.accumulate``; pass the configured
    ``train.accumulate``, so rounding at one size does not carry into the next), as if
    a replica took one in ``1 / share`` seconds. Deterministic, like :func:`best_split`.
    """
    if total < sum(split.dp):
        raise ValueError(f"a global batch of {total} gives a replica of {split.dp} none")
    if total == split.total:
        return split
    times = list(seconds)
    if len(_measured(times)) != len(split.dp):
        times = [1.0 / m for m in (split.accumulate if shares is None else shares)]
    budget = total
    tables = _tables(times, split.dp, budget)
    while not math.isfinite(float(tables[-1][budget])):
        budget += 1
        tables = _tables(times, split.dp, budget)
    return BatchSplit(tuple(_pick(tables, times, split.dp, split.accumulate, budget)), split.dp)
