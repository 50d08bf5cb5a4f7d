"""Corruption: bits flip on the wire and nothing notices (TCP's checksum is weak)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number, geometric_gap


@dataclass(kw_only=True, slots=True, frozen=True)
class Corrupt(Impairment):
    """Flips one random bit of a byte: each byte with probability `rate`, and one byte
    of each piece with probability `per_piece`.

    Which bytes `rate` hits depends only on the seed and the stream position, so a
    run is reproducible however the stream is cut into pieces. Counter:
    `corrupted_bytes`."""

    kind = "corrupt"
    touches_bytes = True
    rate: float = 0.0  # probability that a byte is corrupted, 0..1 (1e-6 = one byte per MB)
    per_piece: float = 0.0
    """Probability that a piece (one read: up to 64 KiB, or 0.5 ms of wire time above
    1 Gbit/s) gets one corrupted byte, 0..1."""
    min_piece_bytes: int = 0
    """per_piece hits only pieces at least this long: bulk data (gradient chunks)
    and not the small control messages around it; 0 = every piece."""

    def __post_init__(self) -> None:
        check_number("corrupt.rate", self.rate, high=1.0)
        check_number("corrupt.per_piece", self.per_piece, high=1.0)
        check_number("corrupt.min_piece_bytes", self.min_piece_bytes)

    def start(self, state: State, loop_time: float) -> None:
        # per_piece draws from its own stream, so `rate`'s positions stay independent
        # of how many pieces there were.
        state.extra["piece_rng"] = random.Random(state.rng.getrandbits(64))

    def apply(self, piece: Piece, state: State, now: float) -> None:
        n = piece.size
        start = state.position
        state.position += n
        if n == 0:
            return
        hits: list[tuple[int, int]] = []  # (offset in the piece, bit)
        if self.rate > 0:
            if state.next_event < 0:
                state.next_event = geometric_gap(state.rng, self.rate) - 1
            while state.next_event < start + n:
                hits.append((state.next_event - start, state.rng.randrange(8)))
                state.next_event += geometric_gap(state.rng, self.rate)
        piece_rng = state.extra["piece_rng"]
        if self.per_piece > 0 and n >= self.min_piece_bytes and piece_rng.random() < self.per_piece:
            hits.append((piece_rng.randrange(n), piece_rng.randrange(8)))
        if hits:
            assert piece.data is not None  # touches_bytes: the relay reads them for us
            data = bytearray(piece.data)
            for i, bit in hits:
                data[i] ^= 1 << bit
            piece.data = bytes(data)
            state.counters["corrupted_bytes"] += len(hits)
