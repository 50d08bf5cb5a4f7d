"""[wan]: the link between sites: what `isthmus local` emulates and the lanes size their
flows from (or what `isthmus probe` measured), and what sending across it costs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from isthmus.deploy.config.sections import ConfigError, at_least, positive, require


@dataclass(kw_only=True, slots=True)
class WanSection:
    distance_km: float = 1000.0
    """Emulated fiber distance between every pair of sites; ~4.9 us per km one way."""
    latency_ms: float = -1.0
    """One-way latency; negative derives it from distance_km."""
    bandwidth_mbit: float = 1000.0
    """Link bandwidth in Mbit/s, each direction."""
    per_flow_mbit: float = 0.0
    """Most Mbit/s one TCP connection gets, each direction (public clouds cap a flow:
    AWS at 5 Gbit/s); 0 = no cap. `isthmus local` emulates it, and the lanes open enough
    connections to fill the link (sync.connections = 0)."""
    queue_kib: int = 1024
    """Buffering beyond the bandwidth-delay product, KiB."""
    probe: str = ""
    """A file of `isthmus probe --json`: its slowest link's RTT, N-flow rate and per-flow
    cap replace latency_ms, bandwidth_mbit and per_flow_mbit as the config loads; the
    key is then cleared, so the resolved config holds the figures. Empty = none."""
    egress_usd_per_gb: float = 0.0
    """What a GB sent from one site to another costs, USD (clouds charge about 0.02
    between regions); 0 = not priced. The summary prices each link's bytes."""
    egress_prices: dict[str, float] = field(default_factory=dict)
    """USD per GB of particular links, by "A-B" (sites A and B, either way), over
    egress_usd_per_gb; e.g. { "site0-site2" = 0.09 }."""
    egress_budget_usd: float = 0.0
    """The run's egress budget, USD; 0 = none. The summary sets the spend against it and
    the progress line says once when a site's spend passes it."""

    @property
    def one_way_latency_s(self) -> float:
        return self.latency_ms / 1000.0 if self.latency_ms >= 0 else self.distance_km * 4.9e-6

    def take_probe(self) -> str:
        """Take latency, bandwidth and per-flow cap from the probe file; what was taken."""
        rtt, self.bandwidth_mbit, self.per_flow_mbit, line = read_probe(self.probe)
        self.latency_ms, self.probe = rtt / 2, ""
        return line

    def egress_price(self, a: str, b: str) -> float:
        """USD per GB sent between sites ``a`` and ``b`` (either way)."""
        prices = self.egress_prices
        return prices.get(f"{a}-{b}", prices.get(f"{b}-{a}", self.egress_usd_per_gb))

    def check(self, sites: list[str]) -> None:
        positive("wan", self, "bandwidth_mbit")
        at_least("wan", self, distance_km=0, queue_kib=0, egress_usd_per_gb=0, egress_budget_usd=0)
        require(
            self.per_flow_mbit >= 0,
            f"wan.per_flow_mbit must be >= 0 (0 = no cap), got {self.per_flow_mbit}",
        )
        for link, price in self.egress_prices.items():
            a, _, b = link.partition("-")
            require(
                a in sites and b in sites and a != b and price >= 0,
                f"wan.egress_prices.{link} = {price}: name a link A-B of two sites of "
                f"{', '.join(sites)}, priced >= 0 USD per GB",
            )


def read_probe(path: str) -> tuple[float, float, float, str]:
    """The RTT (ms), rate and per-flow cap (Mbit/s, 0 = none) of the slowest link in an
    `isthmus probe --json` file, and one line saying what was taken."""
    try:
        links = json.loads(Path(path).read_text())["links"]
        rtt = max(link["rtt_ms"] for link in links)
        mbit = min(link["gbit_nflows"] for link in links) * 1000
        caps = [link["per_flow_cap_gbit"] * 1000 for link in links if link["per_flow_cap_gbit"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not an `isthmus probe --json` file ({exc})") from None
    cap = min(caps, default=0.0)
    line = (
        f"wan from {path} (slowest of {len(links)} link(s)): RTT {rtt:.2f} ms, "
        f"{mbit:,.0f} Mbit/s, " + (f"{cap:,.0f} Mbit/s a flow" if cap else "no per-flow cap")
    )
    return rtt, mbit, cap, line
