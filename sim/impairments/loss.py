"""Loss, seen from a TCP byte stream: a lost segment stalls the stream, nothing is lost."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number, geometric_gap

MSS_BYTES = 1448
"""TCP payload per segment on a 1500-byte MTU path with timestamps."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Loss(Impairment):
    """Each segment of the direction's byte stream is lost with probability `rate`.

    TCP retransmits it, so the receiver gets every byte, later: the piece holding a
    lost segment (and, in order, everything after it on that connection) arrives
    `delay_ms` late. A piece (one read: up to 64 KiB, or 0.5 ms of wire time above
    1 Gbit/s) of n bytes is ceil(n / segment_bytes) segments; losses within one piece
    (less than a window) are recovered together, as SACK does. Which segments are lost
    depends only on the seed and the segment count.
    Counters: `lost_segments`, `stalls`, `stalled_s`."""

    kind = "loss"
    rate: float  # probability that a segment is lost, 0..1
    segment_bytes: int = MSS_BYTES  # segment size, bytes
    delay_ms: float | None = None
    """Retransmission delay per stall, milliseconds; None = the link's RTT (fast
    retransmit). Use e.g. 200 for Linux's minimum retransmission timeout."""

    def __post_init__(self) -> None:
        check_number("loss.rate", self.rate, high=1.0)
        size = self.segment_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"loss.segment_bytes must be an int >= 1, got {size!r}")
        if self.delay_ms is not None:
            check_number("loss.delay_ms", self.delay_ms)

    def apply(self, piece: Piece, state: State, now: float) -> None:
        # Small writes go out as a segment each (the relay and isthmus set TCP_NODELAY).
        segments = -(-piece.size // self.segment_bytes)
        start, end = state.position, state.position + segments  # positions in segments
        state.position = end
        if self.rate <= 0 or segments == 0:
            return
        if state.next_event < 0:  # index of the next lost segment
            state.next_event = start + geometric_gap(state.rng, self.rate) - 1
        lost = 0
        while state.next_event < end:
            lost += 1
            state.next_event += geometric_gap(state.rng, self.rate)
        if lost:
            delay = state.rtt_s if self.delay_ms is None else self.delay_ms / 1000.0
            piece.at += delay
            state.counters["lost_segments"] += lost
            state.counters["stalls"] += 1
            # typeshed types a Counter's values as int; Python's docs allow any number.
            state.counters["stalled_s"] += delay  # type: ignore[assignment]
