"""Cross-site all-reduces over real gRPC lanes on loopback, one thread per site.

What the all-reduce tests share (tests/inter/test_allreduce.py, test_allreduce_codecs.py,
test_allreduce_cuda.py, test_bulk.py, test_convergence.py, test_integrity.py): ``sites``
wires n sites' lane servers, peers and all-reduces together (``two_sites_over``: across an
emulated link); ``run_all`` runs one
callable per site, each in its own thread; ``inputs`` draws every site's tensors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from isthmus.inter.data.codecs.chain import make_codec
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.allreduce import CrossSiteAllReduce

CHUNK = 4096  # bytes: 1024 fp32 per chunk, small so odd tensor sizes straddle chunks


@contextlib.contextmanager
def sites(
    n: int,
    codec: str = "raw",
    timeout_s: float = 10.0,
    connections: int = 1,
    chunk_bytes: int = CHUNK,
    transport: str = "auto",
    max_workers: int = 32,
) -> Iterator[list[CrossSiteAllReduce]]:
    servers = [
        LaneServer(
            site_index=i,
            num_sites=n,
            codec=make_codec(codec).name,
            generation=7,
            chunk_bytes=chunk_bytes,
            max_workers=max_workers,
        )
        for i in range(n)
    ]
    peers = [
        {
            j: LanePeer(
                servers[j].address,
                chunk_bytes=chunk_bytes,
                connections=connections,
                transport=transport,
            )
            for j in range(n)
            if j != i
        }
        for i in range(n)
    ]
    ars = [
        CrossSiteAllReduce(
            site_index=i,
            num_sites=n,
            server=servers[i],
            peers=peers[i],
            codec=make_codec(codec),
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
            generation=7,
        )
        for i in range(n)
    ]
    try:
        yield ars
    finally:
        for ar in ars:
            ar.close()
        for p in peers:
            for peer in p.values():
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

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a site hung"
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
    security: Callable[[int], object] | None = None,
    transport: str = "auto",
) -> Iterator[tuple[list[CrossSiteAllReduce], list[LaneServer], object]]:
    """Two raw sites whose lanes cross one emulated link of ``spec`` (a ``LinkSpec``):
    yields their all-reduces, lane servers and the link (for its stats). The caller
    names no gRPC proxy exception (``no_grpc_proxy``), so lanes cross the link.
    ``security(site)`` gives a site's ``SiteSecurity`` (mutual TLS: chunks go on
    ``PushChunks`` streams)."""
    from isthmus.sim import RelayServer

    secure = security or (lambda site: None)
    with RelayServer() as relay:
        link = relay.add_link("site0-site1", spec)
        proxies = {0: link.add_proxy(initiator="a"), 1: link.add_proxy(initiator="b")}
        servers = [
            LaneServer(
                site_index=i,
                num_sites=2,
                codec="raw",
                chunk_bytes=chunk_bytes,
                security=secure(i),  # type: ignore[arg-type]
            )
            for i in range(2)
        ]
        peers = [
            LanePeer(
                servers[1 - i].address,
                chunk_bytes=chunk_bytes,
                proxy="http://{}:{}".format(*proxies[i]),
                connections=connections,
                security=secure(i),  # type: ignore[arg-type]
                transport=transport,
            )
            for i in range(2)
        ]
        ars = [
            CrossSiteAllReduce(
                site_index=i,
                num_sites=2,
                server=servers[i],
                peers={1 - i: peers[i]},
                codec=make_codec("raw"),
                chunk_bytes=chunk_bytes,
                timeout_s=timeout_s,
            )
            for i in range(2)
        ]
        try:
            yield ars, servers, link
        finally:
            for ar in ars:
                ar.close()
            for peer in peers:
                peer.close()
            for server in servers:
                server.stop(0)
