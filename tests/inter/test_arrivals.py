"""A silent peer's deadline follows its arrivals (inter/control/arrivals.py): on a clock
the test moves, then with real coordinators whose peer dies."""

from __future__ import annotations

import time

import pytest
from coordinators import running_sites
from helpers import wait_until

from isthmus.inter.control.arrivals import FLOOR_PERIODS, MIN_GAPS, ArrivalDeadlines


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beats(arrivals: ArrivalDeadlines, clock: Clock, gaps: list[float], name: str = "b") -> None:
    for gap in gaps:
        clock.now += gap
        arrivals.heard(name)


def test_a_steady_peer_is_found_dead_after_its_learned_deadline_not_the_ceiling() -> None:
    clock = Clock()
    arrivals = ArrivalDeadlines(period_s=0.2, ceiling_s=10.0, clock=clock)
    arrivals.heard("b")
    beats(arrivals, clock, [0.2] * (MIN_GAPS - 1))
    assert arrivals.deadline_s("b") == 10.0  # too few gaps known: the ceiling
    beats(arrivals, clock, [0.2])
    assert arrivals.deadline_s("b") == pytest.approx(FLOOR_PERIODS * 0.2)
    clock.now += 0.79
    assert not arrivals.silent("b", since=0.0)
    clock.now += 0.02
    assert arrivals.silent("b", since=0.0)


def test_a_jittery_peer_gets_a_longer_deadline_and_none_passes_the_ceiling() -> None:
    clock = Clock()
    steady, jittery = (ArrivalDeadlines(period_s=0.2, ceiling_s=10.0, clock=clock) for _ in "ab")
    for arrivals, gaps in ((steady, [0.2, 0.2]), (jittery, [0.05, 0.45])):
        arrivals.heard("b")
        beats(arrivals, clock, gaps * 40)
    assert jittery.deadline_s("b") > 1.5 * steady.deadline_s("b")
    beats(jittery, clock, [0.1, 30.0] * 40)  # wild gaps: the ceiling holds
    assert jittery.deadline_s("b") == 10.0


def test_an_owner_that_ran_late_hears_everyone_late_and_condemns_nobody_for_it() -> None:
    clock = Clock()
    arrivals = ArrivalDeadlines(period_s=0.2, ceiling_s=10.0, clock=clock)
    arrivals.heard("b")
    beats(arrivals, clock, [0.2] * 20)
    arrivals.sleeping_until(clock.now + 0.2)
    clock.now += 3.0  # the owner's loop is starved: it is 2.8 s late now
    assert arrivals.own_lag_s() == pytest.approx(2.8)
    assert not arrivals.silent("b", since=0.0)
    arrivals.woke()  # the stall ended now: silence counts from here, its lag remembered
    clock.now += 1.0
    assert not arrivals.silent("b", since=0.0)
    assert arrivals.deadline_s("b") == pytest.approx(FLOOR_PERIODS * 0.2 + 2.8)
    clock.now += 2.7
    assert arrivals.silent("b", since=0.0)


def test_a_member_never_heard_is_counted_from_when_it_was_expected() -> None:
    clock = Clock()
    arrivals = ArrivalDeadlines(period_s=0.2, ceiling_s=2.0, clock=clock)
    arrivals.expect("c")
    clock.now += 1.9
    assert not arrivals.silent("c", since=0.0)
    clock.now += 0.2
    assert arrivals.silent("c", since=0.0)
    with pytest.raises(ValueError, match="period_s, ceiling_s > 0"):
        ArrivalDeadlines(period_s=0.0, ceiling_s=2.0)


def test_real_coordinators_find_a_dead_peer_long_before_the_failure_timeout() -> None:
    # A 60 s ceiling: only the deadline learned from site1's heartbeats (0.1 s apart)
    # can find it dead within the wait below, however busy the machine (its own lag
    # lengthens the deadline by as long as it stalls, not past the ceiling).
    with running_sites(2, heartbeat_s=0.1, failure_timeout_s=60.0) as coords:
        site0, site1 = coords

        def learned() -> bool:
            with site0.state.cond:
                return site0.state.arrivals.deadline_s("site1") < 60.0

        wait_until(learned, "site0 learned site1's deadline from its heartbeats", 30)
        site1.stop(grace_s=0)
        killed = time.monotonic()
        with site0.state.cond:
            assert "site1" not in site0.state.suspects_locked()

        def suspected() -> bool:
            with site0.state.cond:
                return "site1" in site0.state.suspects_locked()

        wait_until(suspected, "site0 suspects the dead site1 before the 60 s ceiling", 50)
        assert time.monotonic() - killed < 60
