"""Sites whose ranks open their cross-site sync as deploy does (``open_rank_sync``), for
tests of what a step's vote does to its rounds: a real coordinator per site, real
lanes on loopback, and each site's one rank with its real ``SiteMembership`` and
``LaneGradientSync``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from coordinators import FP, coordinator, rank_key
from lanes import CHUNK, run_all

from isthmus.inter.control.coordinator import Coordinator
from isthmus.inter.control.coordinator_client import CoordinatorClient
from isthmus.inter.data import LaneGradientSync, RankSync, RankSyncSettings, open_rank_sync


def settings(
    site: str, names: list[str], *, timeout_s: float, decision_timeout_s: float, codec: str = "raw"
) -> RankSyncSettings:
    """Rank 0 of a one-rank ``site`` with small chunks (odd sizes straddle them)."""
    return RankSyncSettings(
        site=site,
        rank=0,
        world_size=1,
        job_sites=tuple(names),
        fingerprint=FP,
        codec=codec,
        chunk_bytes=CHUNK,
        timeout_s=timeout_s,
        decision_timeout_s=decision_timeout_s,
    )


@contextmanager
def opened_sites(
    n: int = 2, *, decision_timeout_s: float, lane_timeout_s: float = 10.0
) -> Iterator[tuple[list[RankSync], list[Coordinator]]]:
    """``n`` sites of one rank each, started together: yields each rank's open sync
    (the joined generation adopted) and each site's coordinator (stop one to have the
    site die)."""
    names = [f"site{i}" for i in range(n)]
    coords = [coordinator(name, names) for name in names]
    clients: list[CoordinatorClient] = []
    opened: list[RankSync] = []
    try:
        for c in coords:
            c.set_peers({o.site: o.address for o in coords if o is not c}, None)
            c.start()
        clients = [CoordinatorClient.connect(c.address, rank_key=rank_key(c)) for c in coords]
        # Each open waits for the job's membership, which needs every site's rank.
        results = run_all(
            [
                lambda c=c, client=client: open_rank_sync(
                    settings(
                        c.site,
                        names,
                        timeout_s=lane_timeout_s,
                        decision_timeout_s=decision_timeout_s,
                    ),
                    client,
                )
                for c, client in zip(coords, clients, strict=True)
            ]
        )
        opened = [r for r in results if isinstance(r, RankSync)]
        failed = [r for r in results if not isinstance(r, RankSync)]
        assert not failed, failed
        yield opened, coords
    finally:
        for rank_sync in opened:
            rank_sync.close()
        for client in clients:
            client.close()
        for c in coords:
            c.stop()


@contextmanager
def joined_sites(
    n: int = 2, *, decision_timeout_s: float, lane_timeout_s: float = 10.0
) -> Iterator[tuple[list[LaneGradientSync], list[Coordinator]]]:
    """As :func:`opened_sites`, yielding each rank's gradient sync."""
    with opened_sites(n, decision_timeout_s=decision_timeout_s, lane_timeout_s=lane_timeout_s) as (
        opened,
        coords,
    ):
        yield [r.sync for r in opened], coords
