"""One direction of an emulated long-haul link: the pipe that imposes a `DirectionSpec`.

A `DirectionPipe` is shared by every connection that crosses one direction of a link,
because a link's bandwidth is shared. It keeps a serialization clock (each piece leaves
at `max(now, next_free) + len * 8 / bandwidth` and reaches the far end `latency_s`
later) and bounds the bytes in flight by `bandwidth * delay` plus the queue
(`DirectionSpec.queue_limit_bytes`), so a sender feels the bandwidth-delay product as TCP
backpressure instead of filling an unbounded buffer. A direction may also cap each
connection (`per_flow_bps`, a token bucket: `charge_flow`). Each piece then passes the
direction's impairments in order (`sim/impairments/`), which may delay it, hold it back
on its connection, change its bytes, split its delivery or reset its connection, but
never drop bytes while both ends are alive.

The bytes themselves are moved by the direction's `Pump` (`sim/pump.py`), a thread of
its own; this class is the bookkeeping it asks, safe to call from any thread. Times
are `time.monotonic()` seconds."""

from __future__ import annotations

import asyncio
import heapq
import random
import socket
import threading
import time
from collections import Counter

from .connect import FAST_BUFFER_BYTES, SOCKET_BUFFER_BYTES
from .impairments import Impairment, Piece, State
from .pump import Connection, Pump
from .spec import DirectionSpec

PIECE_BYTES = 64 * 1024
"""Smallest bound on a piece read from a socket at once; a fast link reads up to
`PIECE_WIRE_S` of its wire time (at most `MAX_PIECE_BYTES`) per piece instead, so
that the clock stays fine-grained without a syscall per 64 KiB at 25 Gbit/s."""
PIECE_WIRE_S = 0.5e-3
MAX_PIECE_BYTES = 1 << 20
FLOW_PIECE_WIRE_S = 2e-3
"""A capped flow's pieces (and its token bucket's depth) hold about this much of its
cap's wire time: longer than `PIECE_WIRE_S`, so that a 5 Gbit/s flow moves ~1 MiB a
piece as an uncapped one does (the pump's Python work is per piece: pieces 4x smaller
would cost 4x the CPU of the thread that moves the whole link)."""
BUFFER_WIRE_S = 1e-3
"""Socket buffers of a connection hold about this much of the link's wire time."""


class DirectionPipe:
    """One direction of a link, shared by all connections crossing it; thread-safe.
    `name` ("a_to_b" or "b_to_a") is mixed into the impairments' seeds."""

    def __init__(self, spec: DirectionSpec, name: str = "a_to_b") -> None:
        self.name = name
        self.reverse: DirectionPipe | None = None  # for the round-trip time; None = symmetric
        self._spec = spec
        self._lock = threading.Lock()
        self._inflight = 0
        self._next_free = 0.0
        self._on_wire: list[tuple[float, int]] = []  # heap of (leaves the wire at, bytes)
        self._chain: list[tuple[Impairment, State]] | None = None
        self._touches_bytes = False
        self._resets_at: list[float] = []  # Reset.at_s times not yet passed
        self.counters: Counter[str] = Counter()  # what the impairments did
        self.bytes_delivered = 0  # written to receivers (by the pump)
        self.connections = 0  # whose initiator sends on this direction
        self.pump = Pump(self)

    @property
    def spec(self) -> DirectionSpec:
        """The spec applied to bytes entering the pipe now."""
        return self._spec

    @property
    def inflight_bytes(self) -> int:
        """Bytes admitted to the link and not yet off the wire."""
        return self._inflight

    @property
    def touches_bytes(self) -> bool:
        """Whether an impairment reads or changes the bytes (the pump must copy them)."""
        return self._touches_bytes

    def stats(self) -> dict[str, float]:
        """bytes_delivered, connections, inflight_bytes and the impairments' counters."""
        with self._lock:
            return {
                "bytes_delivered": self.bytes_delivered,
                "connections": self.connections,
                "inflight_bytes": self._inflight,
                **self.counters,
            }

    def update(self, spec: DirectionSpec) -> None:
        """Apply `spec` to bytes entering after this call; bytes in flight keep their times.
        New impairments (or a new seed) start afresh: new random streams, `at_s` from now."""
        with self._lock:
            old, self._spec = self._spec, spec
            if self._chain is None or (old.impairments, old.seed) != (spec.impairments, spec.seed):
                self._install(time.monotonic())
        self.pump.wake()  # a larger bound may admit waiting senders

    def reset_connections(self) -> None:
        self.pump.reset_all()

    def carry(
        self, conn: Connection, src: socket.socket, dst: socket.socket, first: bytes = b""
    ) -> None:
        """Move bytes from `src` to `dst` across this direction until EOF (then shut `dst`'s
        write side), on the pump thread; `first`: what was read after a CONNECT head."""
        self.pump.add(conn, src, dst, first)

    def close(self) -> None:
        self.pump.close()

    async def cross(self) -> None:
        """Wait as long as an empty message takes to cross (latency and impairments)."""
        now = time.monotonic()
        with self._lock:
            piece = self._impaired(Piece(data=b"", wire_at=now + self._spec.latency_s, at=0.0), now)
        await asyncio.sleep(max(0.0, piece.at - time.monotonic()))

    def socket_buffer_bytes(self) -> int:
        """Socket buffers for a connection on this direction: about 1 ms of its rate,
        from `SOCKET_BUFFER_BYTES` to `FAST_BUFFER_BYTES`. Set when a connection starts,
        so that the kernel's buffering stays small against the link's in-flight bound."""
        spec = self._spec
        if spec.unlimited:
            return FAST_BUFFER_BYTES
        wanted = int(spec.bandwidth_bps * BUFFER_WIRE_S / 8)
        return max(SOCKET_BUFFER_BYTES, min(FAST_BUFFER_BYTES, wanted))

    # -- called by the pump thread ---------------------------------------------------

    def piece_limit(self) -> int:
        """Most bytes to read from a sender at once now (the link's own bound)."""
        spec = self._spec
        if spec.unlimited:
            return MAX_PIECE_BYTES
        return max(PIECE_BYTES, min(MAX_PIECE_BYTES, int(spec.bandwidth_bps * PIECE_WIRE_S / 8)))

    def flow_piece_limit(self) -> int:
        """Most bytes to read from one capped flow at once, and its token bucket's depth:
        `piece_limit`, and no more than `FLOW_PIECE_WIRE_S` of its cap (at least
        `PIECE_BYTES`), so that a slow flow's pieces are spaced finely."""
        spec = self._spec
        limit = self.piece_limit()
        if not spec.flow_capped:
            return limit
        return min(limit, max(PIECE_BYTES, int(spec.per_flow_bps * FLOW_PIECE_WIRE_S / 8)))

    def charge_flow(self, free_at: float, size: int, now: float) -> float:
        """A flow's token bucket after it sent `size` bytes at `now`, kept as the time
        `free_at` when it is next non-negative: a flow may send while `free_at <= now`,
        each piece moves it on by its time at the cap, and an idle flow's credit is one
        piece (`flow_piece_limit`), which also absorbs the pump's late wake-ups. The piece
        crosses the link no sooner than the returned time. 0.0: a new flow, or no cap."""
        spec = self._spec
        if not spec.flow_capped:
            return 0.0
        burst_s = self.flow_piece_limit() * 8 / spec.per_flow_bps
        return max(free_at, now - burst_s) + size * 8 / spec.per_flow_bps

    def room(self, now: float) -> tuple[int, float | None]:
        """Bytes the link admits now, and when room is next released (None: nothing
        on the wire). An empty link admits any piece, so a piece larger than the bound
        cannot deadlock; a nearly full one admits nothing below a quarter of a piece,
        so that the clock does not shred the stream into slivers."""
        with self._lock:
            heap = self._on_wire
            while heap and heap[0][0] <= now:
                self._inflight -= heapq.heappop(heap)[1]
            nxt = heap[0][0] if heap else None
            limit = self.piece_limit()
            if self._inflight == 0:
                return limit, nxt
            room = min(limit, self._spec.inflight_limit_bytes - self._inflight)
            return (room if room >= min(limit, self._spec.inflight_limit_bytes) // 4 else 0), nxt

    def admit(
        self, data: bytes | None, size: int, now: float, flow_done: float = 0.0, flow: int = -1
    ) -> Piece:
        """Put `size` bytes on the wire behind those before them; return the piece with
        its times (and bytes, if an impairment changed them). It arrives no sooner than
        `flow_done` (when its last bit leaves its flow's shaper, `charge_flow`) plus the
        latency: the shaper holds the flow back instead of reserving the link's clock, so
        a capped flow leaves no idle gap for the others. `flow`: `Stream.flow`, or -1."""
        with self._lock:
            spec = self._spec
            self._next_free = max(now, self._next_free) + spec.serialization_s(size)
            # off the wire at the far end
            arrival = max(self._next_free, flow_done) + spec.latency_s
            piece = Piece(data=data, size=size, wire_at=arrival, at=0.0, flow=flow)
            piece = self._impaired(piece, now)
            self._inflight += size
            heapq.heappush(self._on_wire, (piece.wire_at, size))
            return piece

    def eof(self, now: float, flow: int = -1) -> Piece:
        """The piece that carries a sender's EOF on connection `flow`: after the bytes
        before it."""
        with self._lock:
            at = max(now, self._next_free) + self._spec.latency_s
            return self._impaired(Piece(data=b"", wire_at=at, at=0.0, flow=flow), now)

    def due_reset(self, now: float) -> tuple[bool, float | None]:
        """Whether a `Reset.at_s` time has passed (each counts once), and the next one."""
        with self._lock:
            passed = [t for t in self._resets_at if t <= now]
            self._resets_at = [t for t in self._resets_at if t > now]
            return bool(passed), min(self._resets_at, default=None)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def _install(self, now: float) -> None:
        spec = self._spec
        self._chain = []
        self._resets_at = []
        for i, imp in enumerate(spec.impairments):
            rng = random.Random(f"{spec.seed}/{self.name}/{i}/{imp.kind}")
            state = State(rng=rng, installed_at=now, counters=self.counters)
            imp.start(state, now)
            at = imp.reset_at(state)
            if at is not None:
                self._resets_at.append(at)
            self._chain.append((imp, state))
        self._touches_bytes = any(imp.touches_bytes for imp in spec.impairments)

    def _impaired(self, piece: Piece, now: float) -> Piece:
        """Run the chain on a piece whose `wire_at` (its arrival) is set."""
        if self._chain is None:
            self._install(now)
        assert self._chain is not None
        piece.at = piece.wire_at
        back = self.reverse.spec if self.reverse is not None else self._spec
        for imp, state in self._chain:
            state.rtt_s = self._spec.latency_s + back.latency_s
            imp.apply(piece, state, now)
        return piece
