"""When a frame in flight on one connection is overdue: both transports' rule.

A long link can black-hole one TCP flow while the others carry on (an ECMP path that
died, a middlebox that lost one connection's state), and a peer can stop reading while
its kernel still acknowledges segments. Neither ends the connection in time
(``TCP_USER_TIMEOUT`` after 30 s, or never), so every frame in flight has a deadline
from its size and the connection's measured rate (docs/wire.md, "Deadlines per
frame"); ``bulk_peer.py`` and ``push.py`` keep one :class:`FlowClock` per connection.
"""

from __future__ import annotations

import math

__all__ = [
    "FIRST_RATE_BPS",
    "LOSS_REDIAL_S",
    "MAX_BACKOFF",
    "MAX_LOSSES",
    "RATE_SLACK",
    "STALL_FLOOR_S",
    "FlowClock",
]

STALL_FLOOR_S = 3.0
"""Seconds a frame's acknowledgement may be late past what its size at the
connection's measured rate predicts (a few round trips of any real link, and a
receiver's hiccup on a loaded host), before the connection counts as stalled."""
RATE_SLACK = 4.0
"""A frame may take this many times as long as the connection's measured rate says."""
FIRST_RATE_BPS = 32e6
"""Bytes a second assumed before a connection's first acknowledgement (a 256 Mbit/s
flow's worth)."""
MAX_BACKOFF = 8
"""A connection that stalls again at once waits up to this many times longer (a
whole link gone dark for a while is not many stalls)."""
MAX_LOSSES = 4
"""Times in a row a connection may be lost (a reset, a TLS record that failed its MAC)
before the rounds with chunks on it fail: the link, or the peer, is down."""
LOSS_REDIAL_S = 3.0
"""How long a connection lost under its frames may take to come back before the rounds
waiting on it fail: a live peer answers a redial at once, one that went away never."""


class FlowClock:
    """One connection's measured rate and the deadline of its oldest frame in flight.

    Not thread-safe: its connection calls it under its own lock. The module's
    constants are read at each call (tests shorten the floor).
    """

    def __init__(self) -> None:
        self.last_ack = 0.0  # when the peer last acknowledged a frame here
        self.rate = 0.0  # bytes a second of acknowledged frames (smoothed); 0: none yet
        self.backoff = 1  # doubles with each stall in a row, back to 1 on an ack

    def began(self, sent_at: float) -> float:
        """When a frame sent at ``sent_at`` could begin to be taken: sent, and the
        frame before it acknowledged."""
        return max(sent_at, self.last_ack)

    def allowed(self, size: int) -> float:
        """Seconds a frame of ``size`` bytes may take from :meth:`began`: its size at
        the measured rate with :data:`RATE_SLACK`, plus :data:`STALL_FLOOR_S`, times
        the backoff."""
        rate = self.rate or FIRST_RATE_BPS
        return (RATE_SLACK * size / rate + STALL_FLOOR_S) * self.backoff

    def due(self, sent_at: float | None, size: int) -> float:
        """When the oldest frame in flight (sent at ``sent_at``, ``size`` bytes) is
        overdue; inf with none in flight (``sent_at`` None)."""
        if sent_at is None:
            return math.inf
        return self.began(sent_at) + self.allowed(size)

    def acknowledged(self, sent_at: float, size: int, now: float) -> None:
        """Folds a frame acknowledged at ``now`` into the rate; ends a backoff."""
        began = self.began(sent_at)
        if now > began:
            sample = size / (now - began)
            self.rate = sample if not self.rate else 0.7 * self.rate + 0.3 * sample
        self.last_ack, self.backoff = now, 1

    def stalled(self) -> None:
        """The oldest frame missed its deadline: the next one waits twice as long (up
        to :data:`MAX_BACKOFF` times)."""
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)
