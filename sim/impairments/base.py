"""What every impairment shares: the piece it acts on, its per-direction state, the base.

An impairment is a frozen dataclass of parameters (the spec, comparable and printable)
whose methods act on a `Piece` with a `State` that the direction's pipe keeps for it:
a `random.Random` seeded from the link's seed, the time it was installed, a position in
the direction's byte stream and the direction's counters. A piece knows its connection
(`Piece.flow`), for the impairments that act on one connection only (`flow_stall`).
Replacing a direction's impairments starts fresh states; changing only its bandwidth or
latency keeps them."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class Piece:
    """Bytes read at once from a sender (at most 1 MiB) on their way across a direction."""

    data: bytes | None
    """The payload, or None where the bytes stay in the kernel (spliced from socket to
    socket unseen: no impairment of the direction reads them). An impairment that
    reads or changes bytes (`touches_bytes`) gets them; it never shortens them."""
    wire_at: float
    """Time (`time.monotonic()`) at which the bytes leave the wire at the far end: the
    link's in-flight budget is held until then. Changed only by impairments on the
    wire (jitter)."""
    at: float
    """Time at which the receiver may get them: `wire_at` plus stream-level holds
    (a retransmission stall, a blackout). Kept in order per connection by the pipe."""
    reset: bool = False
    """Reset the connection (both sides get RST) instead of delivering this piece."""
    slices: list[int] | None = None  # write the data as slices of these sizes, `slice_gap_s` apart
    slice_gap_s: float = 0.0
    size: int = -1  # bytes in the piece; -1 = len(data)
    flow: int = -1
    """The connection it belongs to: the index of its stream in the order the
    direction's pump took them on (`Stream.flow`, from 0); -1 = none (the crossing of
    a CONNECT or SYN). Only impairments that act per connection read it."""

    def __post_init__(self) -> None:
        if self.size < 0:
            self.size = len(self.data or b"")


@dataclass(slots=True)
class State:
    """One impairment's mutable state in one direction."""

    rng: random.Random
    installed_at: float  # `time.monotonic()`; `at_s` parameters count from it
    counters: Counter[str]  # the direction's (shared by its impairments): `Link.stats`
    rtt_s: float = 0.0  # the link's round-trip propagation time now
    position: int = 0  # bytes of this direction's stream seen so far
    next_event: int = -1  # position of the next lost segment / corrupted byte; -1: not drawn
    extra: dict[str, Any] = field(default_factory=dict)


def check_number(name: str, value: object, *, low: float = 0.0, high: float = math.inf) -> None:
    """Raise ValueError naming `name` unless `value` is a finite real number in [low, high]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


def geometric_gap(rng: random.Random, p: float) -> int:
    """Trials up to and including the next success of probability `p` (>= 1): drawing
    gaps, not one coin per byte, makes events' stream positions independent of how the
    stream was cut into pieces."""
    if p >= 1.0:
        return 1
    u = 1.0 - rng.random()  # in (0, 1]
    return int(math.log(u) / math.log1p(-p)) + 1


@dataclass(kw_only=True, slots=True, frozen=True)
class Impairment:
    """Base of the impairments; subclasses set `kind` and override what they need."""

    kind: ClassVar[str] = ""
    touches_bytes: ClassVar[bool] = False
    """Whether `apply` reads or changes `piece.data`. The relay splices the bytes of a
    direction without it from socket to socket in the kernel, never copying them."""

    def max_delay_s(self) -> float:
        """Most seconds this adds on the wire; widens the in-flight bound (rate x delay)."""
        return 0.0

    def start(self, state: State, loop_time: float) -> None:
        """Called once when installed, at time `loop_time` (`time.monotonic()`)."""

    def apply(self, piece: Piece, state: State, now: float) -> None:
        """Act on a piece entering the direction at time `now` (`time.monotonic()`)."""

    def reset_at(self, state: State) -> float | None:
        """Time (`time.monotonic()`) at which every connection on the direction is
        reset, or None."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """The parameters as written in a topology file, `kind` first."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            out[f.name] = getattr(self, f.name)
        return out
