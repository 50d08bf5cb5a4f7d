"""Transparent mode: unmodified TCP programs in per-site namespaces, joined by the relay
(docs/transparent.md).

`isthmus.sim.netns` gives each site a network namespace whose outgoing TCP the root
namespace REDIRECTs to that site's listener here. A listener reads the connection's
original destination (`SO_ORIGINAL_DST`); another site of the same job gets the
connection through the `Link` between the two, anything else is reset: the relay
never reaches past the job's namespaces. `TransparentWan` is the whole thing in one
object, with a teardown that runs however it ends."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

from .connect import close_with_rst, tune
from .netns import DEFAULT_POOL, SiteNet, create_sites, redirect_tcp, teardown
from .relay import Link, RelayServer
from .spec import LinkSpec

__all__ = ["TransparentRelay", "TransparentWan", "original_destination"]

SO_ORIGINAL_DST = 80
"""getsockopt(SOL_IP, SO_ORIGINAL_DST): the destination before a REDIRECT (linux/netfilter_ipv4.h)."""
_START_TIMEOUT_S = 10.0


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """The (address, port) a REDIRECTed IPv4 connection was addressed to; OSError when
    `sock` was not redirected by netfilter (ENOENT) or is not IPv4."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # struct sockaddr_in
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


class TransparentRelay:
    """One listener per site, on the site's gateway, for its REDIRECTed connections.
    `links`: (source, destination) -> (link, the source's end "a" or "b") for every
    ordered pair of distinct sites."""

    def __init__(
        self, sites: list[SiteNet], links: dict[tuple[str, str], tuple[Link, str]]
    ) -> None:
        self._sites = sites
        self._links = links
        self._by_address = {a: s.site for s in sites for a in s.addresses}
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._listeners: list[socket.socket] = []
        self.ports: dict[str, int] = {}  # site -> its listener's port (on its gateway)
        self.relayed = 0  # connections handed to a link
        self.refused = 0  # connections reset: their destination is not another site of the job

    def start(self) -> dict[str, int]:
        """Bind the listeners and start accepting in a daemon thread; site -> port."""
        for site in self._sites:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(sock)  # accepted sockets inherit the relay's small buffers
            sock.bind((site.gateway, 0))
            sock.listen(512)
            sock.setblocking(False)
            self.ports[site.site] = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="isthmus-transparent", daemon=True
        )
        self._thread.start()
        for site, sock in zip(self._sites, self._listeners, strict=True):
            asyncio.run_coroutine_threadsafe(self._accept(site, sock), self._loop)
        return dict(self.ports)

    async def _accept(self, site: SiteNet, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, (peer, _) = await loop.sock_accept(listener)
            except OSError:
                return  # closed
            self._route(site, client, peer)

    def _route(self, site: SiteNet, client: socket.socket, peer: str) -> None:
        try:
            host, port = original_destination(client)
        except OSError:
            host, port = "", 0  # not redirected: someone dialled the listener itself
        dest = self._by_address.get(host)
        if peer not in site.addresses or dest is None or dest == site.site:
            self.refused += 1
            close_with_rst(client)
            return
        link, initiator = self._links[(site.site, dest)]
        self.relayed += 1
        try:
            link.carry_connection(client, (host, port), initiator)
        except RuntimeError:
            return  # the relay is closing; carry_connection closed the socket

    def close(self) -> None:
        """Stop accepting and join the thread (idempotent); carried connections are the
        links' and end with the relay."""
        if self._thread is not None:

            async def stop() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(_START_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_START_TIMEOUT_S)
            self._thread = None
        for sock in self._listeners:  # after the accept tasks let go of them
            sock.close()
        self._listeners.clear()
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()


class TransparentWan:
    """A job's sites in namespaces, every pair joined by one emulated link; a context
    manager whose `close()` removes the namespaces, veths and rules however it ends.
    `spec` is every link's (a = the lower-numbered site); `control` (loopback host, port
    0 = any) serves `isthmus wan show/set`; `job`, `pool`, `nodes`: as `create_sites`."""

    def __init__(
        self,
        job: str,
        sites: int,
        spec: LinkSpec,
        *,
        pool: str = DEFAULT_POOL,
        control: tuple[str, int] | None = None,
        nodes: list[int] | None = None,
    ) -> None:
        if not isinstance(spec, LinkSpec):
            raise ValueError(f"spec must be a LinkSpec, got {spec!r}")
        self.job = job
        self._count = sites
        self._spec = spec
        self._pool = pool
        self.sites: list[SiteNet] = []
        self.relay = RelayServer()
        self.links: dict[str, Link] = {}  # "siteI-siteJ" (I < J) -> the link between them
        self._transparent: TransparentRelay | None = None
        self._created = False
        self._control = control
        self._nodes = nodes
        self.control_address: str | None = None  # "host:port", when one was asked for

    def start(self) -> TransparentWan:
        """Create everything; on failure remove what was created and raise."""
        try:
            self.sites = create_sites(self.job, self._count, pool=self._pool, nodes=self._nodes)
            self._created = True
            self.relay.start()
            pairs: dict[tuple[str, str], tuple[Link, str]] = {}
            for i, a in enumerate(self.sites):
                for b in self.sites[i + 1 :]:
                    link = self.relay.add_link(f"{a.site}-{b.site}", self._spec)
                    self.links[link.name] = link
                    pairs[(a.site, b.site)] = (link, "a")
                    pairs[(b.site, a.site)] = (link, "b")
            self._transparent = TransparentRelay(self.sites, pairs)
            ports = self._transparent.start()
            for (src, _), (link, initiator) in pairs.items():
                gateway = self.site(src).gateway
                link.note_listener("transparent", initiator, (gateway, ports[src]), None)
            if self._control is not None:
                self.control_address = self.relay.serve_control(*self._control).address
            for site in self.sites:
                redirect_tcp(self.job, site, ports[site.site])
        except BaseException:
            self.close()
            raise
        return self

    @property
    def relayed(self) -> int:
        """Connections handed to a link."""
        return self._transparent.relayed if self._transparent else 0

    @property
    def refused(self) -> int:
        """Connections reset because they were addressed outside the job."""
        return self._transparent.refused if self._transparent else 0

    def site(self, name: str) -> SiteNet:
        """The site called `name` ("site0", ...)."""
        for s in self.sites:
            if s.site == name:
                return s
        raise KeyError(name)

    def close(self) -> None:
        """Remove the rules, namespaces and veths, stop the relay (idempotent)."""
        try:
            if self._created:
                self._created = False
                teardown(self.job)  # first: no new connection reaches a closing relay
        finally:
            if self._transparent is not None:
                self._transparent.close()
                self._transparent = None
            self.relay.close()

    def __enter__(self) -> TransparentWan:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
