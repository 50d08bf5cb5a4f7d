"""Sites wired as deploy/cross_site.py wires a rank, for tests of what a step's vote
does to its rounds: a real coordinator per site, real lanes on loopback, and each
site's one rank with its real ``SiteMembership`` and ``LaneGradientSync``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from coordinators import FP, coordinator, rank_key
from helpers import register_rank
from lanes import sites

from isthmus.inter.control.coordinator import Coordinator
from isthmus.inter.control.coordinator_client import CoordinatorClient
from isthmus.inter.data.gradient_sync import LaneGradientSync
from isthmus.inter.data.lane_peer import LanePeer
from isthmus.inter.data.membership import SiteMembership


@contextmanager
def joined_sites(
    n: int = 2, *, decision_timeout_s: float, lane_timeout_s: float = 10.0
) -> Iterator[tuple[list[LaneGradientSync], list[Coordinator]]]:
    """``n`` sites of one rank each, joined in one generation: yields each site's sync
    and its coordinator (stop one to have the site die)."""
    names = [f"site{i}" for i in range(n)]
    with sites(n, timeout_s=lane_timeout_s) as ars:
        coords = [coordinator(name, names) for name in names]
        syncs: list[LaneGradientSync] = []
        try:
            for c in coords:
                c.set_peers({o.site: o.address for o in coords if o is not c}, None)
                c.start()
            for c, ar in zip(coords, ars, strict=True):
                register_rank(c.address, c.site, FP, key=rank_key(c), lane=ar.server.address)
            for c in coords:
                c.wait_ready(20)
            for c, ar in zip(coords, ars, strict=True):
                client = CoordinatorClient.connect(c.address, rank_key=rank_key(c))
                now = client.membership_now(known_generation=0, wait_ms=0, timeout_s=5)
                membership = SiteMembership(
                    client=client,
                    site=c.site,
                    rank=0,
                    allreduce=ar,
                    make_peer=lambda info, rank: LanePeer(info.lane_addresses[rank]),
                    sites=list(now.sites),
                    generation=now.generation,
                    decision_timeout_s=decision_timeout_s,
                )
                syncs.append(LaneGradientSync(ar, membership=membership))
            yield syncs, coords
        finally:
            for sync in syncs:
                sync.close()
            for c in coords:
                c.stop()
