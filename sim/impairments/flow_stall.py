"""Flow stall: one connection of the direction goes dark while the others carry on.

A long-haul link sometimes black-holes a single TCP flow (its ECMP path dies, a
middlebox loses that connection's state) while the link's other flows are untouched;
`flap` darkens the whole direction instead."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Impairment, Piece, State, check_number


@dataclass(kw_only=True, slots=True, frozen=True)
class FlowStall(Impairment):
    """The first `count` connections that carry `min_bytes` or more `at_s` or more
    after the impairment is installed go dark for `duration_s` each, counted from the
    arrival time of the piece that picked them.

    A picked connection's bytes (and its EOF) are held, none lost, and arrive together
    when its dark period ends, as with `flap`; the direction's other connections keep
    their rate, since only the arrival (`Piece.at`) is held, not the link's in-flight
    budget (`Piece.wire_at`). A held connection stops being read once it holds its
    receive window, so its sender feels backpressure. Times are arrivals at the far
    end, as for `flap`. Pieces with no connection (`Piece.flow` < 0: the crossing of a
    CONNECT or SYN) are never held. Counters: `stalled_flows` (connections picked),
    `flow_held_bytes` (their bytes held; distinct from flap's `held_bytes`)."""

    kind = "flow_stall"
    count: int = 1  # how many connections to pick, >= 1; later ones are left alone
    at_s: float = 0.0
    """Connections carrying bytes from this many seconds after installation on are
    candidates, seconds."""
    duration_s: float  # how long each picked connection stays dark, seconds
    min_bytes: int = 1
    """Bytes a connection carries from `at_s` on before it is picked (the piece that
    reaches this many is the first held): a bulk flow's frames, where a channel's
    keepalive pings and small calls would otherwise be picked first."""

    def __post_init__(self) -> None:
        for name in ("count", "min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"flow_stall.{name} must be an integer >= 1, got {value!r}")
        check_number("flow_stall.at_s", self.at_s)
        check_number("flow_stall.duration_s", self.duration_s)

    def start(self, state: State, loop_time: float) -> None:
        # flow -> end of its dark period; at most `count` entries.
        state.extra["dark_until"] = {}
        # flow -> bytes carried from at_s on, while it is not yet picked.
        state.extra["carried"] = {}

    def apply(self, piece: Piece, state: State, now: float) -> None:
        if piece.flow < 0:
            return
        dark_until: dict[int, float] = state.extra["dark_until"]
        until = dark_until.get(piece.flow)
        if until is None:
            # A picking piece carries bytes (an EOF alone does not make a flow a
            # candidate) and arrives at or after at_s.
            if (
                len(dark_until) >= self.count
                or piece.size == 0
                or piece.at < state.installed_at + self.at_s
            ):
                return
            if self.min_bytes > 1:
                carried: dict[int, int] = state.extra["carried"]
                carried[piece.flow] = carried.get(piece.flow, 0) + piece.size
                if carried[piece.flow] < self.min_bytes:
                    return
            until = dark_until[piece.flow] = piece.at + self.duration_s
            state.counters["stalled_flows"] += 1
        if piece.at < until:
            piece.at = until
            state.counters["flow_held_bytes"] += piece.size
