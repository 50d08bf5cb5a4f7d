"""Flap (blackhole): the direction carries nothing for a while, then everything held."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number


@dataclass(kw_only=True, slots=True, frozen=True)
class Flap(Impairment):
    """The direction goes dark for `duration_s`, starting `at_s` after it is installed,
    and again every `every_s` if that is set.

    Bytes that would arrive while dark are held, none lost, and arrive together when
    the link comes back; senders feel it as backpressure once the link's in-flight
    bound is full. Counters: `flaps` (dark periods that held bytes), `held_bytes`."""

    kind = "flap"
    duration_s: float  # how long each dark period lasts, seconds
    at_s: float = 0.0  # start of the first dark period, seconds after the impairment is installed
    every_s: float = 0.0
    """Period of repeated dark periods, seconds; 0 = once. Must exceed duration_s."""

    def __post_init__(self) -> None:
        check_number("flap.duration_s", self.duration_s)
        check_number("flap.at_s", self.at_s)
        check_number("flap.every_s", self.every_s)
        if self.every_s and self.every_s <= self.duration_s:
            raise ValueError(
                f"flap.every_s must be 0 or > duration_s ({self.duration_s}), got {self.every_s}"
            )

    def apply(self, piece: Piece, state: State, now: float) -> None:
        first = state.installed_at + self.at_s
        if piece.at < first:
            return
        k = math.floor((piece.at - first) / self.every_s) if self.every_s else 0
        start = first + k * self.every_s
        if piece.at < start + self.duration_s:
            piece.at = start + self.duration_s
            state.counters["held_bytes"] += piece.size
            if state.extra.get("window") != k:
                state.extra["window"] = k
                state.counters["flaps"] += 1
