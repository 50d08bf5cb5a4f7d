"""Jitter: each piece's one-way delay varies around the link's latency, in order."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number

NORMAL_CLIP_SIGMAS = 3.0
"""A normal draw is clipped to +-3 sigma so that the in-flight bound stays finite."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Jitter(Impairment):
    """Adds a random delay to each piece, drawn per piece from the direction's seed.

    The mean one-way delay stays the link's latency (a delay is never made negative:
    a draw below zero total delay is clipped at zero). Pieces of one connection still
    arrive in order, as TCP delivers them: a piece drawn early waits for the one before,
    so pieces sent back to back see the larger of their delays."""

    kind = "jitter"
    ms: float
    """Spread, milliseconds: the half-width of a uniform draw in [-ms, +ms], or the
    standard deviation of a normal one (clipped to +-3 ms)."""
    distribution: str = "uniform"  # "uniform" or "normal"

    def __post_init__(self) -> None:
        check_number("jitter.ms", self.ms)
        if self.distribution not in ("uniform", "normal"):
            raise ValueError(
                f"jitter.distribution must be uniform or normal, got {self.distribution!r}"
            )

    def max_delay_s(self) -> float:
        sigmas = NORMAL_CLIP_SIGMAS if self.distribution == "normal" else 1.0
        return self.ms * sigmas / 1000.0

    def apply(self, piece: Piece, state: State, now: float) -> None:
        if self.distribution == "uniform":
            delta = state.rng.uniform(-self.ms, self.ms) / 1000.0
        else:
            limit = NORMAL_CLIP_SIGMAS * self.ms
            delta = max(-limit, min(limit, state.rng.gauss(0.0, self.ms))) / 1000.0
        wire_at = max(now, piece.wire_at + delta)
        piece.at += wire_at - piece.wire_at
        piece.wire_at = wire_at
