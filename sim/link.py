"""One emulated long-haul link: per-direction specs and the pipe that imposes them.

A `DirectionPipe` is shared by every connection that crosses one direction of a link,
because a link's bandwidth is shared. It keeps a serialization clock (each piece leaves
at `max(now, next_free) + len * 8 / bandwidth` and arrives `latency_s` later) and bounds
the bytes in flight (read from a sender, not yet delivered) by `bandwidth * latency +
queue_bytes`, so a sender feels the bandwidth-delay product as TCP backpressure instead
of filling an unbounded buffer.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

FIBER_S_PER_KM = 4.9e-6
"""One-way propagation delay of light in fiber (refractive index ~1.47), seconds per km."""

DEFAULT_QUEUE_BYTES = 256 * 1024
PIECE_BYTES = 64 * 1024
"""Largest piece read from a socket at once; small enough that the clock is fine-grained."""

UNLIMITED_WINDOW_BYTES = 16 * 1024 * 1024
"""In-flight bound (plus `queue_bytes`) of a link without a bandwidth limit, whose
bandwidth-delay product is infinite: still finite so that memory stays bounded."""

RECV_WINDOW_BYTES = 256 * 1024
"""Bytes per connection that may have crossed the link but wait for a slow receiver.
Like a TCP receive window it lets a stalled receiver hold its own data without holding
the link's shared in-flight budget, which is released when bytes arrive."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DirectionSpec:
    """The impairments of one direction of a link."""

    latency_s: float
    """One-way propagation delay, seconds."""
    bandwidth_bps: float = 0.0
    """Serialization rate, bits per second; 0 or `math.inf` means unlimited."""
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    """Buffering beyond the bandwidth-delay product (a router queue), bytes."""

    def __post_init__(self) -> None:
        if not isinstance(self.latency_s, (int, float)) or not (
            math.isfinite(self.latency_s) and self.latency_s >= 0
        ):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not isinstance(self.bandwidth_bps, (int, float)) or not self.bandwidth_bps >= 0:
            raise ValueError(
                f"bandwidth_bps must be >= 0 (0 or inf = unlimited), got {self.bandwidth_bps!r}"
            )
        if isinstance(self.queue_bytes, bool) or not isinstance(self.queue_bytes, int):
            raise ValueError(f"queue_bytes must be an int >= 0, got {self.queue_bytes!r}")
        if self.queue_bytes < 0:
            raise ValueError(f"queue_bytes must be an int >= 0, got {self.queue_bytes!r}")

    @property
    def unlimited(self) -> bool:
        """Whether this direction has no bandwidth limit."""
        return self.bandwidth_bps == 0 or math.isinf(self.bandwidth_bps)

    @property
    def inflight_limit_bytes(self) -> int:
        """Bytes that may be in flight: bandwidth-delay product plus queue."""
        if self.unlimited:
            return UNLIMITED_WINDOW_BYTES + self.queue_bytes
        return int(self.bandwidth_bps * self.latency_s / 8) + self.queue_bytes

    def serialization_s(self, nbytes: int) -> float:
        """Seconds that `nbytes` occupy the wire."""
        return 0.0 if self.unlimited else nbytes * 8 / self.bandwidth_bps


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkSpec:
    """Both directions of a link between site a and site b."""

    a_to_b: DirectionSpec
    """Bytes sent by a, received by b."""
    b_to_a: DirectionSpec
    """Bytes sent by b, received by a."""

    def __post_init__(self) -> None:
        for name in ("a_to_b", "b_to_a"):
            if not isinstance(getattr(self, name), DirectionSpec):
                raise ValueError(f"{name} must be a DirectionSpec, got {getattr(self, name)!r}")

    @classmethod
    def symmetric(
        cls,
        *,
        latency_s: float,
        bandwidth_bps: float = 0.0,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
    ) -> LinkSpec:
        """A link with the same spec both ways.

        Args:
            latency_s: one-way delay, seconds.
            bandwidth_bps: bits per second each way; 0 or inf = unlimited.
            queue_bytes: buffering beyond the bandwidth-delay product, bytes.

        Returns:
            The link spec.
        """
        d = DirectionSpec(latency_s=latency_s, bandwidth_bps=bandwidth_bps, queue_bytes=queue_bytes)
        return cls(a_to_b=d, b_to_a=d)

    @classmethod
    def from_distance(
        cls, km: float, bandwidth_bps: float, *, queue_bytes: int = DEFAULT_QUEUE_BYTES
    ) -> LinkSpec:
        """A symmetric link over `km` of fiber (~4.9 us per km one way).

        Args:
            km: fiber route length, kilometres (longer than the great-circle distance).
            bandwidth_bps: bits per second each way; 0 or inf = unlimited.
            queue_bytes: buffering beyond the bandwidth-delay product, bytes.

        Returns:
            The link spec.
        """
        if not isinstance(km, (int, float)) or not (math.isfinite(km) and km >= 0):
            raise ValueError(f"km must be a finite number >= 0, got {km!r}")
        return cls.symmetric(
            latency_s=km * FIBER_S_PER_KM, bandwidth_bps=bandwidth_bps, queue_bytes=queue_bytes
        )

    @property
    def rtt_s(self) -> float:
        """Round-trip propagation time, seconds (no serialization)."""
        return self.a_to_b.latency_s + self.b_to_a.latency_s


class DirectionPipe:
    """One direction of a link, shared by all connections crossing it.

    Lives on one asyncio event loop; call its methods from that loop only.
    """

    def __init__(self, spec: DirectionSpec) -> None:
        self._spec = spec
        self._inflight = 0
        self._next_free = 0.0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
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
        """Bytes admitted to the link and not yet arrived."""
        return self._inflight

    def update(self, spec: DirectionSpec) -> None:
        """Apply `spec` to bytes entering after this call; bytes in flight keep their times."""
        self._spec = spec
        self._wake()  # a larger bound may admit waiting senders

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
            OSError: either side failed (e.g. a reset); the caller closes both.
        """
        loop = asyncio.get_running_loop()
        queue: deque[tuple[float, bytes | None]] = deque()  # (arrival time, data | EOF)
        queued = asyncio.Event()
        room = asyncio.Event()
        unwritten = 0  # admitted, not yet written to the receiver

        async def intake() -> None:
            nonlocal unwritten
            last = 0.0  # arrivals stay in order per connection even if latency drops
            while True:
                while unwritten > self._spec.inflight_limit_bytes + RECV_WINDOW_BYTES:
                    room.clear()
                    await room.wait()
                # Read only now, so that a full pipe leaves bytes in the sender's socket.
                data = await reader.read(PIECE_BYTES)
                if not data:
                    at = max(loop.time(), self._next_free) + self._spec.latency_s
                    queue.append((max(at, last), None))
                    queued.set()
                    return
                n = len(data)
                last = max(await self._admit(n), last)
                loop.call_at(last, self._release, n)
                unwritten += n
                queue.append((last, data))
                queued.set()

        async def deliver() -> None:
            nonlocal unwritten
            while True:
                while not queue:
                    queued.clear()
                    await queued.wait()
                delay = queue[0][0] - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                written = 0
                while queue and queue[0][0] <= loop.time():
                    data = queue.popleft()[1]
                    if data is None:
                        await writer.drain()
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    writer.write(data)
                    written += len(data)
                await writer.drain()
                unwritten -= written
                self.bytes_delivered += written
                room.set()

        await run_together(intake(), deliver())


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
