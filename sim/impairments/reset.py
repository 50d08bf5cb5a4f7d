"""Reset: connections on the direction are torn down, both sides getting RST."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number


@dataclass(kw_only=True, slots=True, frozen=True)
class Reset(Impairment):
    """Resets connections: each piece with probability `rate`, and/or every connection
    open `at_s` after the impairment is installed (later connections live on).

    The fatal piece and everything after it never arrive: the relay closes both the
    client's and the target's socket with RST, as a failing middlebox would (bytes
    before it may or may not have been read: an RST discards unread data). Counter:
    `resets` (connections reset)."""

    kind = "reset"
    rate: float = 0.0
    """Probability that a piece (one read: up to 64 KiB, or 0.5 ms of wire time above
    1 Gbit/s) resets its connection, 0..1."""
    at_s: float | None = None
    """Reset every open connection this many seconds after installation; None = never."""

    def __post_init__(self) -> None:
        check_number("reset.rate", self.rate, high=1.0)
        if self.at_s is not None:
            check_number("reset.at_s", self.at_s)

    def apply(self, piece: Piece, state: State, now: float) -> None:
        if self.rate > 0 and piece.size and state.rng.random() < self.rate:
            piece.reset = True

    def reset_at(self, state: State) -> float | None:
        return None if self.at_s is None else state.installed_at + self.at_s
