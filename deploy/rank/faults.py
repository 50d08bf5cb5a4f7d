"""What `isthmus chaos` (deploy/chaos/suite.py) and `isthmus local --slow` ask of a
rank, read once at start from its environment: a slower site, a floor under each
step's time, and a lane that loses its codec threads in the middle of a round."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the chaos suite reads this module's names without importing torch
    from isthmus.inter.data import LaneGradientSync

__all__ = ["LANE_THREADS_LOST_ENV", "FaultInjection", "StepFloor"]

LANE_THREADS_LOST_ENV = "ISTHMUS_LANE_THREADS_LOST_AT_STEP"
"""The step whose cross-site round loses the lane's codec threads (chaos `lane-threads`)."""

LOST_AFTER_TASKS = 2
"""Tasks the round hands its codec threads before they are shut down: past its start,
before its end (a round has a task per chunk and part, many more than two)."""

log = logging.getLogger("isthmus.rank")


@dataclass(kw_only=True, slots=True, frozen=True)
class FaultInjection:
    """The faults asked of this rank; none by default."""

    slowdown: float = 1.0  # each step's compute takes this many times longer
    slow_from_step: int = 0  # the slowdown starts at this step
    step_floor_s: float = 0.0
    """No step is shorter than this, seconds, so a job still runs when a restarted or
    cut-off site comes back, whatever the hardware; until it is back (`StepFloor`)."""
    lane_threads_lost_at: int = -1  # first round from this step on loses codec threads; -1: never

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> FaultInjection:
        return cls(
            slowdown=float(env.get("ISTHMUS_SLOWDOWN", "1")),
            slow_from_step=int(env.get("ISTHMUS_SLOW_FROM_STEP", "0")),
            step_floor_s=float(env.get("ISTHMUS_STEP_FLOOR_S", "0")),
            lane_threads_lost_at=int(env.get(LANE_THREADS_LOST_ENV, "-1")),
        )

    def before_step(self, step: int, sync: LaneGradientSync | None) -> None:
        """At the step asked for, swap the lane's codec threads for a pool that shuts
        itself down after its first tasks: the round in flight then loses them, as it
        would to a crashed native library or an interpreter shutting down."""
        if step != self.lane_threads_lost_at or sync is None:
            return
        allreduce = sync.allreduce
        old, allreduce.pool = allreduce.pool, PoolLostMidRound(allreduce.workers, step)
        old.shutdown(wait=False)

    def pace(self, step: int, compute_s: float, sync_s: float, *, floor: bool = True) -> float:
        """Sleeps after ``step``, which computed ``compute_s`` and synced ``sync_s``
        seconds, and up to the step floor when ``floor``. Returns the seconds of
        slowdown (the site's work made longer: what a balancer must see), not the
        floor's."""
        slowed = 0.0
        if self.slowdown > 1 and step >= self.slow_from_step:
            slowed = (self.slowdown - 1) * compute_s
            time.sleep(slowed)
        if floor and self.step_floor_s > 0:
            time.sleep(max(0.0, self.step_floor_s - compute_s - sync_s))
        return slowed


class StepFloor:
    """Whether the step floor still holds at a rank of a job of ``sites`` sites. The
    floor keeps a job running until a site it lost is back; paced, the steps after that
    were most of the chaos scenarios' time. It lifts once this rank has seen the job short
    of a site and whole again, or came back itself (rejoined, or started past step 0)."""

    def __init__(self, sites: int, start_step: int) -> None:
        self.sites = sites
        self.holds = start_step == 0
        self._short = False

    def after_step(self, live_sites: int) -> bool:
        """Notes the live sites a committed step saw; returns whether the floor holds."""
        if live_sites < self.sites:
            self._short = True
        elif self._short:
            self.holds = False
        return self.holds

    def rejoined(self) -> None:
        """This rank took the live state and went on with the job."""
        self.holds = False


class PoolLostMidRound(futures.ThreadPoolExecutor):
    """Codec threads that are shut down (running tasks finish, queued ones are
    cancelled, later ones refused) once ``LOST_AFTER_TASKS`` tasks were handed to them."""

    def __init__(self, workers: int, step: int) -> None:
        super().__init__(workers, thread_name_prefix="lane-codec")
        self._step, self._tasks = step, 0

    def submit(self, fn, /, *args, **kwargs):
        task = super().submit(fn, *args, **kwargs)
        self._tasks += 1
        if self._tasks == LOST_AFTER_TASKS:
            log.warning("chaos: the lane's codec threads are shut down mid-round (step %d)",
                        self._step)  # fmt: skip
            self.shutdown(wait=False, cancel_futures=True)
        return task
