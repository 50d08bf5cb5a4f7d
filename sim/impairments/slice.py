"""Slicing: a piece reaches the receiver as many small writes, optionally spaced."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number


@dataclass(kw_only=True, slots=True, frozen=True)
class Slice(Impairment):
    """Delivers each piece as writes of `size_bytes` +- `variation_bytes`, `delay_ms`
    apart (toxiproxy's slicer): framing code must cope with any split. Every byte
    arrives, in order. Counter: `slices`."""

    kind = "slice"
    size_bytes: int = 64  # mean size of a write, bytes
    variation_bytes: int = 0
    """Each write's size is drawn uniformly in size_bytes +- this, bytes (< size_bytes)."""
    delay_ms: float = 0.0  # pause between two writes, milliseconds

    def __post_init__(self) -> None:
        for name in ("size_bytes", "variation_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"slice.{name} must be an int >= 0, got {value!r}")
        if not 0 <= self.variation_bytes < self.size_bytes:
            raise ValueError(
                f"slice.variation_bytes must be < size_bytes ({self.size_bytes}), "
                f"got {self.variation_bytes}"
            )
        check_number("slice.delay_ms", self.delay_ms)

    def apply(self, piece: Piece, state: State, now: float) -> None:
        left = piece.size
        sizes = []
        while left > 0:
            var = self.variation_bytes
            size = self.size_bytes + (state.rng.randint(-var, var) if var else 0)
            sizes.append(min(size, left))
            left -= sizes[-1]
        piece.slices = sizes
        piece.slice_gap_s = self.delay_ms / 1000.0
        state.counters["slices"] += len(sizes)
