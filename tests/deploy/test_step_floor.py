"""The chaos step floor holds until a lost site is back, then lifts (deploy/rank/faults.py)."""

from __future__ import annotations

import time

import pytest

import isthmus.deploy.rank.faults as faults_module
from isthmus.deploy.rank.faults import FaultInjection, StepFloor


def test_the_floor_holds_while_the_job_is_whole_and_short_and_lifts_once_whole_again():
    floor = StepFloor(sites=2, start_step=0)
    assert [floor.after_step(live) for live in (2, 2, 2)] == [True] * 3  # before the fault
    assert [floor.after_step(live) for live in (1, 1)] == [True] * 2  # the survivor alone
    assert floor.after_step(2) is False  # the site is back
    assert floor.after_step(1) is False  # and it stays lifted: nothing is left to wait for


def test_a_job_that_never_gets_its_sites_keeps_its_floor():
    floor = StepFloor(sites=3, start_step=0)
    assert all(floor.after_step(live) for live in (2, 2, 1, 2))


def test_a_rank_that_came_back_has_no_floor():
    restarted = StepFloor(sites=2, start_step=7)  # started with the job's state
    assert restarted.after_step(2) is False
    cut_off = StepFloor(sites=2, start_step=0)
    assert cut_off.after_step(2)
    cut_off.rejoined()  # took the live state after the job went on without it
    assert cut_off.after_step(2) is False


def test_pace_sleeps_up_to_the_floor_only_when_asked(monkeypatch):
    # What pace asks to sleep is recorded, so the floor's absence is told apart by what
    # was asked, not by a wall time that a loaded machine stretches.
    naps: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(faults_module.time, "sleep", sleep)
    faults = FaultInjection(step_floor_s=0.6)
    started = time.perf_counter()
    assert faults.pace(3, compute_s=0.1, sync_s=0.0) == 0.0
    assert naps == [pytest.approx(0.5)]  # the floor less the step's own 0.1 s
    assert time.perf_counter() - started >= 0.5  # load only lengthens a sleep
    naps.clear()
    faults.pace(4, compute_s=0.1, sync_s=0.0, floor=False)
    assert sum(naps) == 0.0  # no floor: nothing slept (a floor applied anyway asks 0.5 s)
