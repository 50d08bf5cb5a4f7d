"""Cross-site all-reduces over real gRPC lanes on loopback, one thread per site.

What the all-reduce tests and the lane benchmarks share (tests/inter/test_allreduce.py,
test_bulk.py, test_integrity.py, benchmarks/tls_lanes.py, ...): ``lane_pair`` wires n
sites' lane servers, peers and all-reduces together (``two_sites_over``: across an
emulated link); ``run_all`` runs one callable per site, each in its own thread;
``inputs`` draws every site's tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from helpers import in_threads

from isthmus.inter.data.codecs.chain import make_codec
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.allreduce import CrossSiteAllReduce, FixedMembership
from isthmus.inter.data.transport.link_watch import LinkWatch
from isthmus.inter.security import SiteSecurity

CHUNK = 4096  # bytes: 1024 fp32 per chunk, small so odd tensor sizes straddle chunks


@contextlib.contextmanager
def lane_pair(
    n: int = 2,
    codec: str = "raw",
    timeout_s: float = 10.0,
    connections: int = 1,
    chunk_bytes: int = CHUNK,
    transport: str = "auto",
    max_workers: int = 32,
    security: Callable[[int], SiteSecurity | None] = lambda site: None,
    proxy: Callable[[int], str | None] = lambda site: None,
    watches: list[LinkWatch] | None = None,
) -> Iterator[list[CrossSiteAllReduce]]:
    """Two sites (or ``n``), one lane each, in generation 7: yields each site's
    all-reduce (``ar.server`` its lane, ``ar.membership.peers()`` its clients of the
    other sites' lanes, through ``proxy(site)`` and under ``security(site)``, their
    connections handed to ``watches[site]`` as links named "site{j}")."""
    servers = [
        LaneServer(
            site_index=i,
            num_sites=n,
            codec=make_codec(codec).name,
            generation=7,
            chunk_bytes=chunk_bytes,
            max_workers=max_workers,
            security=security(i),
        )
        for i in range(n)
    ]
    ars = [
        CrossSiteAllReduce(
            membership=FixedMembership(
                servers[i],
                {
                    j: LanePeer(
                        servers[j].address,
                        chunk_bytes=chunk_bytes,
                        proxy=proxy(i),
                        connections=connections,
                        security=security(i),
                        transport=transport,
                        link=watches[i].link(f"site{j}") if watches else None,
                    )
                    for j in range(n)
                    if j != i
                },
            ),
            codec=make_codec(codec),
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
        )
        for i in range(n)
    ]
    try:
        yield ars
    finally:
        for ar in ars:
            ar.close()
        for ar in ars:
            for peer in ar.membership.peers().values():
                peer.close()
        for s in servers:
            s.stop(0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (``torch.equal`` holds -0.0 equal to 0.0; replicas must not
    differ even there)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def run_all(fns: list[Callable[[], object]], timeout: float = 25.0) -> list[object]:
    """Runs each callable in its own thread; returns results (or raised exceptions)."""
    out: list[object] = [None] * len(fns)

    def wrap(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 (handed back to the test)
            out[i] = exc

    threads = in_threads(wrap, range(len(fns)), timeout, daemon=True)
    assert not any(t.is_alive() for t in threads), "a site hung"
    return out


def inputs(num_sites: int, sizes: list[int], seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=g) * (s + 1) for n in sizes] for s in range(num_sites)]


@contextlib.contextmanager
def two_sites_over(
    spec: object,
    chunk_bytes: int,
    connections: int,
    timeout_s: float,
    security: Callable[[int], SiteSecurity | None] = lambda site: None,
    transport: str = "auto",
) -> Iterator[tuple[list[CrossSiteAllReduce], list[LaneServer], object]]:
    """Two raw sites (``lane_pair``) whose lanes cross one emulated link of ``spec`` (a
    ``LinkSpec``): yields their all-reduces, lane servers and the link (for its stats).
    The caller names no gRPC proxy exception (``no_grpc_proxy``), so lanes cross the
    link."""
    from isthmus.sim import RelayServer

    with RelayServer() as relay:
        link = relay.add_link("site0-site1", spec)
        proxies = [link.add_proxy(initiator=side) for side in "ab"]
        with lane_pair(
            chunk_bytes=chunk_bytes,
            connections=connections,
            timeout_s=timeout_s,
            transport=transport,
            security=security,
            proxy=lambda site: "http://{}:{}".format(*proxies[site]),
        ) as ars:
            yield ars, [ar.server for ar in ars], link
