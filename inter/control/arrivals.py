"""When a silent peer is taken for dead: a deadline that follows its own arrivals.

A fixed failure timeout makes every dead site cost the same 10 s whatever the link. Here
(after Hayashibara et al.'s accrual detector) each peer's deadline is learned from the
gaps between the messages it sent: mean + ``SIGMAS`` standard deviations, at least
``FLOOR_PERIODS`` heartbeat periods, at most the configured timeout (the ceiling, also
used until ``MIN_GAPS`` gaps are known). A peer whose arrivals jitter or stall now and
then (a lossy link, a busy host) gets a longer deadline; a steady one is found dead in
under a second. A late verdict is cheaper than a false one, so two guards keep a busy
host from condemning the living:

* this detector's own lag: how late its owner's periodic wake-ups ran lately (and are
  running now) is added to every deadline, since a starved process hears everyone late;
* silence is counted from the latest of the peer's arrival and the end of that lag.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

SIGMAS = 8.0
"""Standard deviations of the gaps beyond their mean before a silence counts."""
FLOOR_PERIODS = 4.0
"""No deadline is below this many heartbeat periods (3 lost in a row are survived)."""
MIN_GAPS = 8
"""Gaps known before the learned deadline replaces the ceiling."""
ALPHA = 0.05
"""Weight of a new gap in the moving mean and variance (about the last 20 gaps)."""
LAG_WAKEUPS = 64
"""Own wake-ups whose lateness is remembered (a stall lengthens deadlines this long)."""


class ArrivalDeadlines:
    """Per-peer arrivals and this owner's own lag; not thread-safe (its owner locks)."""

    def __init__(
        self, *, period_s: float, ceiling_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (period_s > 0 and ceiling_s > 0):
            raise ValueError(f"need period_s, ceiling_s > 0, got {period_s} and {ceiling_s}")
        self.period_s, self.ceiling_s, self.clock = period_s, ceiling_s, clock
        self._last: dict[str, float] = {}
        self._gaps: dict[str, tuple[int, float, float]] = {}  # name -> (count, mean, var)
        self._lags: deque[float] = deque(maxlen=LAG_WAKEUPS)
        self._wake_at: float | None = None
        self._stall_ended_at = clock()  # when the owner last stopped running late

    def heard(self, name: str) -> None:
        """A message from ``name`` arrived now."""
        now = self.clock()
        last = self._last.get(name)
        self._last[name] = now
        if last is None:
            return
        gap = now - last
        count, mean, var = self._gaps.get(name, (0, gap, 0.0))
        diff = gap - mean
        mean += ALPHA * diff
        var = (1 - ALPHA) * (var + ALPHA * diff * diff)
        self._gaps[name] = (count + 1, mean, var)

    def expect(self, name: str) -> None:
        """``name`` is a member from now on: its silence counts from now if never heard."""
        self._last.setdefault(name, self.clock())

    def sleeping_until(self, wake_at: float) -> None:
        """The owner's periodic loop sleeps until ``wake_at`` (on the clock)."""
        self._wake_at = wake_at

    def woke(self) -> None:
        """The owner's loop woke: how late it ran is its lag."""
        if self._wake_at is not None:
            now = self.clock()
            late = max(0.0, now - self._wake_at)
            self._lags.append(late)
            if late > self.period_s:
                self._stall_ended_at = now
            self._wake_at = None

    def own_lag_s(self) -> float:
        """The most this owner's wake-ups ran late lately, or are late now."""
        now_late = 0.0 if self._wake_at is None else max(0.0, self.clock() - self._wake_at)
        return max(now_late, max(self._lags, default=0.0))

    def deadline_s(self, name: str) -> float:
        """Silence after which ``name`` is taken for dead, own lag included."""
        count, mean, var = self._gaps.get(name, (0, 0.0, 0.0))
        if count < MIN_GAPS:
            learned = self.ceiling_s
        else:
            learned = max(FLOOR_PERIODS * self.period_s, mean + SIGMAS * math.sqrt(var))
        return min(self.ceiling_s, learned) + self.own_lag_s()

    def silent(self, name: str, since: float) -> bool:
        """Whether ``name`` has been silent past its deadline; ``since``: when it was
        first expected (before its first message)."""
        heard = max(self._last.get(name, since), self._stall_ended_at)
        return self.clock() - heard > self.deadline_s(name)

    def last_heard(self) -> dict[str, float]:
        """When each peer was last heard from (on the clock)."""
        return dict(self._last)
