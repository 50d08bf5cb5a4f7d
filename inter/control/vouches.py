"""Which ranks a host agent vouches for, on a deadline measured against its own lag.

A host agent (inter/control/host_agent.py) holds its ranks' watches and names, in its one
poll at the coordinator, the ranks it hears from (``vouched_rank_keys``): each counts as
that rank's poll in flight (inter/control/rank_liveness.py), and a rank it stops naming
is declared dead ``failure_timeout_s`` later. A rank is heard from while a watch of its
is held here, and for ``vouch_s`` after the last one ended: time for its watcher to send
the next. A rank whose process ended (its watch cancelled as its socket closed) is not
heard from again, and is dropped ``vouch_s`` after.

That time is the agent's to measure, and an agent starved of CPU measured it wrongly:
2 x 1,024 ranks' agents on 2 cores (issue 59) ran their timers seconds late while the
ranks' next watches sat unread in their sockets, dropped live ranks, and 6 were
declared dead. So the deadline runs on the agent's own time (:class:`OwnTime`): a check
that runs later than ``late_s`` after it was due counts the lateness as time the agent
was away, drops no one, and looks again ``late_s`` later, once what waited in its
sockets was read; only a check on time drops a rank. A rank's own lateness is not
excused: a watcher that sends its next watch ``vouch_s`` late (of the agent's time) is
dropped, and its coordinator still waits ``failure_timeout_s`` before it declares it dead.

Not thread-safe: the agent uses it from its event loop alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["LATE_S", "OwnTime", "Vouches"]

LATE_S = 0.25
"""A check this much later than due was not on time: its owner was away (starved of CPU,
stopped); half a second later than the 0.25 s tick that judged ranks before."""


class OwnTime:
    """The time its owner was there to see: ``clock`` less the time its checks ran late.

    Args:
        clock: seconds, monotonic (a test hands one it moves).
        late_s: a check later than this is late; its lateness is time away.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, late_s: float = LATE_S) -> None:
        if late_s <= 0:
            raise ValueError(f"late_s must be > 0, got {late_s}")
        self._clock = clock
        self.late_s = late_s
        self.away_s = 0.0
        """Seconds its checks ran late, summed: the owner could not have seen anything then."""

    def now(self) -> float:
        return self._clock() - self.away_s

    def on_time(self, due: float) -> bool:
        """A check due at ``due`` (own time) runs now: whether it is on time. Late, the
        lateness is counted as time away (``now()`` moves back to ``due``)."""
        late = self.now() - due
        if late <= self.late_s:
            return True
        self.away_s += late
        return False


class Vouches:
    """The rank keys a host's agent vouches for: those with a watch held, and those
    whose last watch ended less than ``vouch_s`` of the agent's own time ago.

    Args:
        vouch_s: how long after a rank's last watch ended it is still vouched for.
        clock: seconds, monotonic.
        late_s: a check later than this is the agent's lateness (:class:`OwnTime`).
    """

    def __init__(
        self, vouch_s: float, clock: Callable[[], float] = time.monotonic, late_s: float = LATE_S
    ) -> None:
        if vouch_s <= 0:
            raise ValueError(f"vouch_s must be > 0, got {vouch_s}")
        self.vouch_s = vouch_s
        self.time = OwnTime(clock, late_s)
        self._held: dict[str, int] = {}  # key -> its watches held now
        self._ended: dict[str, float] = {}  # key -> own time its last watch ended (none held)
        self._not_before = float("-inf")  # after a late check: the next one, not sooner

    def hold(self, key: str) -> bool:
        """A watch of ``key`` arrived; True when ``key`` was not vouched for."""
        new = key not in self._held and key not in self._ended
        self._held[key] = self._held.get(key, 0) + 1
        self._ended.pop(key, None)
        return new

    def release(self, key: str) -> None:
        """A watch of ``key`` ended (answered, or cancelled by its rank)."""
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
            return
        self._held.pop(key, None)
        self._ended[key] = self.time.now()

    def keys(self) -> list[str]:
        """The keys vouched for, sorted (as a poll names them)."""
        return sorted([*self._held, *self._ended])

    def __len__(self) -> int:
        return len(self._held) + len(self._ended)

    def next_check(self) -> float | None:
        """When (own time) the next rank may be dropped; None when every one is held."""
        if not self._ended:
            return None
        return max(min(self._ended.values()) + self.vouch_s, self._not_before)

    def check(self, due: float) -> bool:
        """Runs the check that was due at ``due`` (own time, :meth:`next_check`): drops
        the keys past ``vouch_s``; True when it dropped one. A check that runs late
        drops none, and the next runs ``late_s`` later: the watches that waited in the
        agent's sockets while it was away are read first."""
        if not self.time.on_time(due):
            self._not_before = self.time.now() + self.time.late_s
            return False
        now = self.time.now()
        gone = [key for key, at in self._ended.items() if now - at >= self.vouch_s]
        for key in gone:
            del self._ended[key]
        return bool(gone)
