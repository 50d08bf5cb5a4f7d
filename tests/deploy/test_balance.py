"""The balancer's split (deploy/batch/balance.py): exact, deterministic, and it holds the batch."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from isthmus.deploy.batch.balance import BatchSplit, best_split, resized


def _slowest(seconds: list[float], accumulate: tuple[int, ...]) -> float:
    return max(m * t for m, t in zip(accumulate, seconds, strict=True))


def _brute_force(seconds: list[float], split: BatchSplit) -> float:
    """The least slowest-site time over every split of the same global batch."""
    best = math.inf
    ranges = [range(1, split.total // d + 1) for d in split.dp]
    for ms in itertools.product(*ranges):
        if sum(m * d for m, d in zip(ms, split.dp, strict=True)) == split.total:
            best = min(best, _slowest(seconds, ms))
    return best


def test_a_site_twice_as_slow_gets_half_the_micro_batches():
    split = BatchSplit((3, 3), (1, 1))
    assert best_split([0.1, 0.2], split).accumulate == (4, 2)
    # Per replica: site1 has two replicas, each as fast as site0's one.
    assert best_split([0.1, 0.1], BatchSplit((2, 2), (1, 2))).accumulate == (2, 2)
    assert best_split([0.1, 0.1], BatchSplit((4, 1), (1, 2))).accumulate == (2, 2)


def test_the_split_is_the_best_one_and_holds_the_global_batch():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 3)
        dp = tuple(rng.randint(1, 3) for _ in range(n))
        accumulate = tuple(rng.randint(1, 4) for _ in range(n))
        split = BatchSplit(accumulate, dp)
        seconds = [rng.uniform(0.01, 1.0) for _ in range(n)]
        new = best_split(seconds, split, gain=0.0)
        assert new.total == split.total and new.dp == dp
        assert min(new.accumulate) >= 1
        assert _slowest(seconds, new.accumulate) == pytest.approx(_brute_force(seconds, split))


def test_small_gains_do_not_move_micro_batches():
    split = BatchSplit((3, 3), (1, 1))
    # [4, 2] would be 0.4 against 0.42 now: under 10 % better, so nothing moves.
    assert best_split([0.1, 0.14], split) is split
    assert best_split([0.1, 0.14], split, gain=0.0).accumulate == (4, 2)
    # 0.45 against 0.4: 12.5 % better, it moves.
    assert best_split([0.1, 0.15], split).accumulate == (4, 2)


def test_a_site_that_did_not_report_keeps_its_micro_batches():
    split = BatchSplit((3, 3, 3), (1, 1, 1))
    # Sites 0 and 2 share their 6: [5, 1] takes 0.5 s, [4, 2] would take 0.6.
    assert best_split([0.1, 0.0, 0.3], split).accumulate == (5, 3, 1)
    # Fewer than two sites reported, or a nonsense value: nothing to balance.
    assert best_split([0.1, 0.0, 0.0], split) is split
    assert best_split([0.1, math.nan, math.inf], split) is split


def test_ties_go_to_the_fewest_micro_batches_moved():
    # Site0 twice as slow: (1, 2, 3) and (1, 3, 2) both take 0.3 s; site2, decided
    # first, keeps its 2.
    split = BatchSplit((2, 2, 2), (1, 1, 1))
    assert best_split([0.2, 0.1, 0.1], split, gain=0.0).accumulate == (1, 3, 2)
    # Already best: the split itself comes back.
    assert best_split([0.2, 0.2], BatchSplit((3, 3), (1, 1)), gain=0.0).accumulate == (3, 3)


def test_first_units_number_the_global_batch_site_major():
    split = BatchSplit((2, 3), (2, 1))
    assert split.units == [4, 3] and split.total == 7
    assert [split.first_unit(0, 0), split.first_unit(0, 1), split.first_unit(1, 0)] == [0, 2, 4]


def test_bad_splits_and_timings_are_refused():
    with pytest.raises(ValueError, match="one count >= 1 per site"):
        BatchSplit((0, 2), (1, 1))
    with pytest.raises(ValueError, match="one count >= 1 per site"):
        BatchSplit((1,), (1, 1))
    with pytest.raises(ValueError, match="3 timings for 2 sites"):
        best_split([0.1, 0.1, 0.1], BatchSplit((1, 1), (1, 1)))


def test_a_resized_batch_keeps_the_sites_shares_or_follows_their_speeds():
    split = BatchSplit((4, 4), (1, 1))
    # No timings: the configured shares, whatever rounding the split in use carries.
    assert resized(BatchSplit((2, 1), (1, 1)), 8, shares=(4, 4)).accumulate == (4, 4)
    assert resized(split, 6).accumulate == (3, 3)
    assert resized(BatchSplit((2, 1), (1, 1)), 6).accumulate == (4, 2)
    # Timings of every site: the fastest split of the new size.
    assert resized(split, 6, [0.1, 0.2]).accumulate == (4, 2)
    # One site unmeasured: shares again.
    assert resized(split, 6, [0.1, 0.0]).accumulate == (3, 3)
    assert resized(split, 8) is split


def test_a_batch_whole_micro_batches_cannot_make_rounds_up():
    # dp 2 and 2: only even batches exist.
    split = BatchSplit((2, 2), (2, 2))
    assert resized(split, 7).total == 8
    assert resized(split, 5).total == 6
    # dp 2 and 3 with one micro-batch each at least: 6 is not 2a + 3b with a, b >= 1.
    assert resized(BatchSplit((3, 1), (2, 3)), 6).total == 7
    with pytest.raises(ValueError, match="a global batch of 3 gives a replica"):
        resized(split, 3)
