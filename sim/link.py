"""One direction of an emulated long-haul link: the pipe that imposes a `DirectionSpec`.

A `DirectionPipe` is shared by every connection that crosses one direction of a link,
because a link's bandwidth is shared. It keeps a serialization clock (each piece leaves
at `max(now, next_free) + len * 8 / bandwidth` and reaches the far end `latency_s`
later) and bounds the bytes in flight (read from a sender, not yet off the wire) by
`bandwidth * delay + queue_bytes`, so a sender feels the bandwidth-delay product as TCP
backpressure instead of filling an unbounded buffer.

Each piece then passes the direction's impairments in order (`sim/impairments/`): they
may move its time on the wire (jitter), hold it back on its connection (loss stalls, a
flap), change its bytes (corruption), split its delivery (slicing) or reset its
connection. No impairment drops bytes while both ends are alive.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from typing import Any

from .impairments import Impairment, Piece, State
from .spec import (  # noqa: F401 (re-exported: the specs lived here before spec.py)
    DEFAULT_QUEUE_BYTES,
    FIBER_S_PER_KM,
    UNLIMITED_WINDOW_BYTES,
    DirectionSpec,
    LinkSpec,
)

PIECE_BYTES = 64 * 1024
"""Largest piece read from a socket at once; small enough that the clock is fine-grained."""

RECV_WINDOW_BYTES = 256 * 1024
"""Bytes per connection that may have crossed the link but wait for a slow receiver.
Like a TCP receive window it lets a stalled receiver (or a stalled stream: a loss, a
flap) hold its own data without holding the link's shared in-flight budget, which is
released when bytes leave the wire."""


class DirectionPipe:
    """One direction of a link, shared by all connections crossing it.

    Lives on one asyncio event loop; call its methods from that loop only.

    Args:
        spec: what the direction imposes.
        name: "a_to_b" or "b_to_a"; mixed into the impairments' seeds.
    """

    def __init__(self, spec: DirectionSpec, name: str = "a_to_b") -> None:
        self.name = name
        self.reverse: DirectionPipe | None = None
        """The link's other direction, for the round-trip time; None = symmetric."""
        self._spec = spec
        self._inflight = 0
        self._next_free = 0.0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._chain: list[tuple[Impairment, State]] | None = None  # installed on the loop
        self._timers: list[asyncio.TimerHandle] = []
        self._live: set[Callable[[], None]] = set()  # one reset callback per carry()
        self.counters: Counter[str] = Counter()
        """What the impairments did (lost_segments, corrupted_bytes, resets, ...)."""
        self.bytes_delivered = 0
        """Bytes written to receivers (counter)."""
        self.connections = 0
        """Connections whose initiator sends on this direction (counter)."""

    @property
    def spec(self) -> DirectionSpec:
        """The spec applied to bytes entering the pipe now."""
        return self._spec

    @property
    def inflight_bytes(self) -> int:
        """Bytes admitted to the link and not yet off the wire."""
        return self._inflight

    def update(self, spec: DirectionSpec) -> None:
        """Apply `spec` to bytes entering after this call; bytes in flight keep their times.

        New impairments (or a new seed) start afresh: new random streams, and their
        `at_s` times count from now. Otherwise the running impairments keep their state.
        """
        old, self._spec = self._spec, spec
        if self._chain is None or (old.impairments, old.seed) != (spec.impairments, spec.seed):
            self._install()
        self._wake()  # a larger bound may admit waiting senders

    def reset_connections(self) -> None:
        """Reset every connection carrying bytes on this direction (both sides get RST)."""
        for kill in list(self._live):
            kill()

    async def cross(self) -> None:
        """Wait as long as an empty message takes to cross (latency and impairments)."""
        now = asyncio.get_running_loop().time()
        piece = self._impaired(b"", now + self._spec.latency_s, now)
        await asyncio.sleep(piece.at - now)

    def _install(self) -> None:
        loop = asyncio.get_running_loop()
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        now, spec = loop.time(), self._spec
        self._chain = []
        for i, imp in enumerate(spec.impairments):
            rng = random.Random(f"{spec.seed}/{self.name}/{i}/{imp.kind}")
            state = State(rng=rng, installed_at=now, counters=self.counters)
            imp.start(state, now)
            at = imp.reset_at(state)
            if at is not None:
                self._timers.append(loop.call_at(at, self.reset_connections))
            self._chain.append((imp, state))

    def _impaired(self, data: bytes, wire_at: float, now: float) -> Piece:
        if self._chain is None:
            self._install()
        assert self._chain is not None
        piece = Piece(data=data, wire_at=wire_at, at=wire_at)
        back = self.reverse.spec if self.reverse is not None else self._spec
        for imp, state in self._chain:
            state.rtt_s = self._spec.latency_s + back.latency_s
            imp.apply(piece, state, now)
        return piece

    def _fits(self, n: int) -> bool:
        # An empty pipe admits any piece, so a piece larger than the bound cannot deadlock.
        return self._inflight == 0 or self._inflight + n <= self._spec.inflight_limit_bytes

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._inflight += n
                fut.set_result(None)

    def _release(self, n: int) -> None:
        self._inflight -= n
        self._wake()

    async def _admit(self, n: int) -> float:
        """Wait for room for `n` bytes (FIFO across connections); return their arrival time."""
        if self._waiters or not self._fits(n):
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((n, fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release(n)  # admitted just as we were cancelled
                raise
        else:
            self._inflight += n
        now = asyncio.get_running_loop().time()
        self._next_free = max(now, self._next_free) + self._spec.serialization_s(n)
        return self._next_free + self._spec.latency_s

    async def carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Move bytes from `reader` to `writer` across this direction until EOF.

        The EOF is delivered after the data in flight, as a shutdown of `writer`'s
        write side. Neither stream is closed here.

        Args:
            reader: the sending side.
            writer: the receiving side.

        Raises:
            OSError: either side failed, or an impairment reset the connection
                (`ConnectionResetError`); the caller closes both sides.
        """
        loop = asyncio.get_running_loop()
        queue: deque[tuple[float, Piece, bool]] = deque()  # (arrival, piece, is EOF)
        wake = asyncio.Event()  # something was queued, is due, or the connection is reset
        room = asyncio.Event()
        unwritten = 0  # admitted, not yet written to the receiver
        reset = False

        def kill() -> None:
            nonlocal reset
            reset = True
            wake.set()

        async def intake() -> None:
            nonlocal unwritten
            last = 0.0  # arrivals stay in order per connection even if delays drop
            while True:
                while unwritten > self._spec.inflight_limit_bytes + RECV_WINDOW_BYTES:
                    room.clear()
                    await room.wait()
                # Read only now, so that a full pipe leaves bytes in the sender's socket.
                data = await reader.read(PIECE_BYTES)
                if not data:
                    now = loop.time()
                    at = max(now, self._next_free) + self._spec.latency_s
                    eof = self._impaired(b"", at, now)
                    queue.append((max(eof.at, last), eof, True))
                    wake.set()
                    return
                n = len(data)
                wire_at = await self._admit(n)
                piece = self._impaired(data, wire_at, loop.time())
                loop.call_at(piece.wire_at, self._release, n)
                last = max(piece.at, last)
                unwritten += n
                queue.append((last, piece, False))
                wake.set()

        async def deliver() -> None:
            nonlocal unwritten
            while True:
                delay = queue[0][0] - loop.time() if queue else None
                if not reset and (delay is None or delay > 0):
                    timer = loop.call_later(delay, wake.set) if delay is not None else None
                    wake.clear()
                    await wake.wait()
                    if timer is not None:
                        timer.cancel()
                    continue
                written = 0
                while queue and queue[0][0] <= loop.time() and not reset:
                    _, piece, eof = queue.popleft()
                    if eof:
                        await writer.drain()
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    if piece.reset:
                        kill()
                        break
                    written += await _write(writer, piece)
                if reset:
                    self.counters["resets"] += 1
                    raise ConnectionResetError(f"{self.name}: connection reset by an impairment")
                await writer.drain()
                unwritten -= written
                self.bytes_delivered += written
                room.set()

        self._live.add(kill)
        try:
            await run_together(intake(), deliver())
        finally:
            self._live.discard(kill)


async def _write(writer: asyncio.StreamWriter, piece: Piece) -> int:
    """Write a piece, in slices if an impairment sliced it; return its length."""
    if piece.slices is None:
        writer.write(piece.data)
        return len(piece.data)
    offset = 0
    for size in piece.slices:
        writer.write(piece.data[offset : offset + size])
        offset += size
        await writer.drain()  # one send per slice
        if piece.slice_gap_s > 0 and offset < len(piece.data):
            await asyncio.sleep(piece.slice_gap_s)
    return offset


async def run_together(*coros: Coroutine[Any, Any, None]) -> None:
    """Run coroutines until all finish; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
