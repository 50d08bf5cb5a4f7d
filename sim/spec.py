"""The specs of an emulated link: what each direction imposes, and both together.

A `DirectionSpec` is a value (frozen, comparable): latency, bandwidth, queue, the
chain of impairments and the seed they draw from. `DirectionPipe` (in `link.py`)
applies one to live bytes; `Link.update` swaps in a new one."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .impairments import Impairment

FIBER_S_PER_KM = 4.9e-6
"""One-way propagation delay of light in fiber (refractive index ~1.47), seconds per km."""

DEFAULT_QUEUE_BYTES = 256 * 1024

MIN_QUEUE_S = 2e-3
"""The least queue a bandwidth-limited direction keeps, in seconds of its rate (a
`queue_bytes` below it counts as this). The pump that feeds the wire is a Python loop
that tops it up only when it runs; under load it runs a millisecond or more late. With a
queue shallower than that, the wire sits idle while the pump catches up (256 KiB is 0.2
ms at 10 Gbit/s): one lane across 10 Gbit/s moved 86 % of the link with 256 KiB and 99 %
with this floor, 4 lanes across 25 Gbit/s 82 % and 92 % (docs/benchmarks/wan-emulator.md, "The
emulator's queue"). Routers on long-haul links hold tens of ms, so no real link is
shallower than this floor."""

UNLIMITED_WINDOW_BYTES = 16 * 1024 * 1024
"""In-flight bound (plus `queue_bytes`) of a link without a bandwidth limit, whose
bandwidth-delay product is infinite: still finite so that memory stays bounded."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Trace:
    """A direction's spec as a step function of time (`sim/trace.py` reads and replays it):
    row i's values hold from `times[i]`, seconds since the link started, until the next."""

    path: str  # the CSV file it was read from
    times: tuple[float, ...]  # 0 first, strictly increasing
    rows: tuple[tuple[tuple[str, float], ...], ...]  # each row's (column, value) pairs


@dataclass(kw_only=True, slots=True, frozen=True)
class DirectionSpec:
    """The impairments of one direction of a link."""

    latency_s: float  # one-way propagation delay, seconds
    bandwidth_bps: float = 0.0
    """Serialization rate, bits per second; 0 or `math.inf` means unlimited."""
    per_flow_bps: float = 0.0
    """Most each TCP flow (one relayed connection, this direction) may carry, bits per
    second, on top of `bandwidth_bps` that all flows share, as public clouds cap one
    flow (AWS: 5 Gbit/s); 0 or `math.inf` means no cap."""
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    """Buffering beyond the bandwidth-delay product (a router queue), bytes."""
    impairments: tuple[Impairment, ...] = ()
    """Applied in order to every piece of bytes entering the direction."""
    seed: int = 0
    """Seeds one `random.Random` per impairment (with the direction's name and the
    impairment's index and kind), so a run is reproducible."""
    trace: Trace | None = None
    """Replayed by the relay: each row changes the keys it names at its time."""

    def __post_init__(self) -> None:
        lat, bw, queue = self.latency_s, self.bandwidth_bps, self.queue_bytes
        flow = self.per_flow_bps
        if not isinstance(lat, (int, float)) or not (math.isfinite(lat) and lat >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {lat!r}")
        if not isinstance(bw, (int, float)) or not bw >= 0:
            raise ValueError(f"bandwidth_bps must be >= 0 (0 or inf = unlimited), got {bw!r}")
        if isinstance(flow, bool) or not isinstance(flow, (int, float)) or not flow >= 0:
            raise ValueError(f"per_flow_bps must be >= 0 (0 or inf = no cap), got {flow!r}")
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
            raise ValueError(f"queue_bytes must be an int >= 0, got {queue!r}")
        if not isinstance(self.impairments, tuple) or not all(
            isinstance(i, Impairment) for i in self.impairments
        ):
            raise ValueError(f"impairments must be a tuple of Impairment, got {self.impairments!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.trace is not None and not isinstance(self.trace, Trace):
            raise ValueError(f"trace must be a Trace or None, got {self.trace!r}")

    @property
    def unlimited(self) -> bool:
        """Whether this direction has no bandwidth limit."""
        return self.bandwidth_bps == 0 or math.isinf(self.bandwidth_bps)

    @property
    def flow_capped(self) -> bool:
        """Whether each flow has a rate cap of its own (`per_flow_bps`)."""
        return self.per_flow_bps != 0 and not math.isinf(self.per_flow_bps)

    @property
    def queue_limit_bytes(self) -> int:
        """The queue the direction keeps: `queue_bytes`, and at least `MIN_QUEUE_S` of
        its rate."""
        if self.unlimited:
            return self.queue_bytes
        return max(self.queue_bytes, int(self.bandwidth_bps * MIN_QUEUE_S / 8))

    @property
    def inflight_limit_bytes(self) -> int:
        """Bytes that may be in flight: bandwidth x (latency + the most that the
        impairments add on the wire) plus the queue (`queue_limit_bytes`)."""
        if self.unlimited:
            return UNLIMITED_WINDOW_BYTES + self.queue_bytes
        delay_s = self.latency_s + sum(i.max_delay_s() for i in self.impairments)
        return int(self.bandwidth_bps * delay_s / 8) + self.queue_limit_bytes

    def serialization_s(self, nbytes: int) -> float:
        """Seconds that `nbytes` occupy the wire."""
        return 0.0 if self.unlimited else nbytes * 8 / self.bandwidth_bps


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkSpec:
    """Both directions of a link between site a and site b."""

    a_to_b: DirectionSpec  # bytes sent by a, received by b
    b_to_a: DirectionSpec

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
        per_flow_bps: float = 0.0,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        impairments: tuple[Impairment, ...] = (),
        seed: int = 0,
    ) -> LinkSpec:
        """A link with the same spec both ways (each direction still draws its own
        random numbers: the pipe mixes the direction's name into the seed)."""
        d = DirectionSpec(
            latency_s=latency_s,
            bandwidth_bps=bandwidth_bps,
            per_flow_bps=per_flow_bps,
            queue_bytes=queue_bytes,
            impairments=tuple(impairments),
            seed=seed,
        )
        return cls(a_to_b=d, b_to_a=d)

    @classmethod
    def from_distance(
        cls,
        km: float,
        bandwidth_bps: float,
        *,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        per_flow_bps: float = 0.0,
    ) -> LinkSpec:
        """A symmetric link over `km` of fiber route (~4.9 us per km one way; longer than
        the great-circle distance)."""
        if not isinstance(km, (int, float)) or not (math.isfinite(km) and km >= 0):
            raise ValueError(f"km must be a finite number >= 0, got {km!r}")
        return cls.symmetric(
            latency_s=km * FIBER_S_PER_KM,
            bandwidth_bps=bandwidth_bps,
            queue_bytes=queue_bytes,
            per_flow_bps=per_flow_bps,
        )

    @property
    def rtt_s(self) -> float:
        """Round-trip propagation time, seconds (no serialization)."""
        return self.a_to_b.latency_s + self.b_to_a.latency_s
