"""A TCP relay that carries connections across emulated links, on a background thread.

`RelayServer` runs an asyncio loop in a daemon thread; each `Link` owns the two
`DirectionPipe`s of one pair of sites and any number of listeners on 127.0.0.1:
forwards (every connection goes to one fixed target) and HTTP CONNECT proxies (the
client names a loopback target; only loopback targets are ever connected to). The
CONNECT handshake and the socket set-up are in `isthmus.sim.connect`.

gRPC through a proxy listener (grpcio 1.84): the channel option `("grpc.http_proxy",
"http://127.0.0.1:PORT")` (`proxy_channel_options`) tunnels targets written `127.0.0.1:N`,
`localhost:N` or `ipv4:127.0.0.1:N` and beats the `http_proxy`/`https_proxy`/`grpc_proxy`
variables; but `no_grpc_proxy` / `no_proxy` (the first set wins) silently bypass it for
hosts they list, and many machines set `no_proxy=localhost,127.0.0.1`: unset them, or set
`no_grpc_proxy=none.invalid` (a name that matches nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .connect import (
    ESTABLISHED,
    SOCKET_BUFFER_BYTES,
    HttpError,
    close_with_rst,
    is_loopback,
    listening_socket,
    open_target,
    read_connect,
    refuse,
    set_nodelay,
    tune,
)
from .control import ControlServer
from .impairments import Impairment
from .link import DirectionPipe
from .pump import Connection
from .pump_process import RemoteDirection
from .spec import LinkSpec
from .trace import Replay, follow

CALL_TIMEOUT_S = 30.0
T = TypeVar("T")


def proxy_channel_options(address: tuple[str, int]) -> list[tuple[str, Any]]:
    """gRPC channel options that route a channel through the proxy listener at
    ``address`` (what `Link.add_proxy` returned)."""
    return [("grpc.enable_http_proxy", 1), ("grpc.http_proxy", f"http://{address[0]}:{address[1]}")]


Direction = DirectionPipe | RemoteDirection  # pumped by a thread of the relay, or a process


class Link:
    """Two directions between sites a and b, and the listeners that feed them. Public
    methods are thread-safe: they run on the relay's loop and wait for it."""

    def __init__(
        self, name: str, spec: LinkSpec, loop: asyncio.AbstractEventLoop, processes: bool = False
    ) -> None:
        self.name = name
        self._spec = spec
        self._loop = loop
        self._pipes: dict[str, Direction]
        if processes:  # each direction pumped by a process of its own (sim/pump_process.py)
            remote: dict[str, RemoteDirection] = {}
            remote["a"] = RemoteDirection(spec.a_to_b, "a_to_b", lambda c: remote["b"].fail(c))
            remote["b"] = RemoteDirection(spec.b_to_a, "b_to_a", lambda c: remote["a"].fail(c))
            self._pipes = dict(remote)
        else:
            self._pipes = {
                "a": DirectionPipe(spec.a_to_b, "a_to_b"),
                "b": DirectionPipe(spec.b_to_a, "b_to_a"),
            }
        self._pipes["a"].reverse, self._pipes["b"].reverse = self._pipes["b"], self._pipes["a"]
        self._listening: list[socket.socket] = []
        self.listeners: list[dict[str, Any]] = []
        """One entry per listener: kind ("forward", "proxy" or "transparent"), initiator
        ("a" or "b"), address ("HOST:PORT") and, for a forward, target ("HOST:PORT")."""
        self._handlers: set[asyncio.Task[None]] = set()  # accept loops and handshakes
        self._closed = False
        self.targets_connected = 0  # outbound connections the relay opened to targets
        self.proxy_refused = 0  # CONNECT requests answered 400/403, connecting nowhere
        self.lock = threading.RLock()  # held while the spec is read and changed
        self.replay: Replay | None = None  # the spec's traces, replayed (sim/trace.py)

    @property
    def spec(self) -> LinkSpec:
        """The spec applied to new bytes."""
        return self._spec

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError(f"link {self.name!r}: relay is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    def add_forward(
        self, target_host: str, target_port: int, initiator: str = "a"
    ) -> tuple[str, int]:
        """Listen on 127.0.0.1 and forward every connection to one loopback target;
        returns (host, port). ``initiator``: the connecting clients' site, "a" or "b"."""
        if not is_loopback(target_host):
            raise ValueError(f"target_host must be a loopback address, got {target_host!r}")
        address = self._call(self._listen(initiator, (target_host, int(target_port))))
        self.note_listener("forward", initiator, address, f"{target_host}:{int(target_port)}")
        return address

    def add_proxy(self, initiator: str = "a", port: int = 0) -> tuple[str, int]:
        """Listen on 127.0.0.1 (``port``; 0 lets the OS pick) as an HTTP CONNECT proxy to
        loopback targets for clients of site ``initiator``; returns (host, port)."""
        address = self._call(self._listen(initiator, None, port))
        self.note_listener("proxy", initiator, address, None)
        return address

    def note_listener(
        self, kind: str, initiator: str, address: tuple[str, int], target: str | None
    ) -> None:
        entry = {"kind": kind, "initiator": initiator, "address": f"{address[0]}:{address[1]}"}
        self.listeners.append(entry if target is None else {**entry, "target": target})

    def update(self, spec: LinkSpec) -> None:
        """Change both directions of the live link, for bytes sent afterwards; changed
        impairments (or seed) restart: fresh random streams, `at_s` counted from now; new
        traces start from their first row now."""
        if not isinstance(spec, LinkSpec):
            raise ValueError(f"spec must be a LinkSpec, got {spec!r}")
        with self.lock:
            if self._closed or self._loop.is_closed():
                raise RuntimeError(f"link {self.name!r}: relay is closed")
            self.replay, self._spec = follow(self.replay, spec, self)
            self._pipes["a"].update(self._spec.a_to_b)
            self._pipes["b"].update(self._spec.b_to_a)

    def set_impairments(
        self,
        a_to_b: tuple[Impairment, ...] | None = None,
        b_to_a: tuple[Impairment, ...] | None = None,
    ) -> None:
        """Replace the impairments of bytes sent by a (``a_to_b``) and by b; None keeps a
        direction's, () removes them all."""
        with self.lock:
            spec = self._spec
            for name, chain in (("a_to_b", a_to_b), ("b_to_a", b_to_a)):
                if chain is not None:
                    d = dataclasses.replace(getattr(spec, name), impairments=tuple(chain))
                    spec = dataclasses.replace(spec, **{name: d})
            self.update(spec)

    def reset(self) -> None:
        """Reset every connection on the link now: both sides get RST."""
        for pipe in self._pipes.values():
            pipe.reset_connections()

    def stats(self) -> dict[str, dict[str, float]]:
        """Counters per direction ("a_to_b", "b_to_a"): bytes_delivered, connections (from
        that direction's initiator), inflight_bytes (now), and what the impairments did
        (lost_segments, stalled_flows, resets, ...), each present once it is non-zero."""
        return {"a_to_b": self._pipes["a"].stats(), "b_to_a": self._pipes["b"].stats()}

    def carry_connection(
        self, client: socket.socket, target: tuple[str, int], initiator: str = "a"
    ) -> None:
        """Carry a connection accepted outside the relay (by `isthmus.sim.transparent`,
        which checks the target itself: it may be any IPv4 address, so never pass one a
        client chose freely) to `target`, across the link; either side failing resets
        both. Returns at once; the link owns `client`, site ``initiator``'s socket."""
        if initiator not in self._pipes:
            client.close()
            raise ValueError(f"initiator must be 'a' or 'b', got {initiator!r}")
        out, back = self._pipes[initiator], self._pipes["b" if initiator == "a" else "a"]

        async def carry() -> None:
            out.connections += 1
            far: socket.socket | None = None
            try:
                client.setblocking(False)
                await out.cross()  # the SYN crosses the link before the far side sees it
                far = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                tune(far)
                set_nodelay(far)
                far.setblocking(False)
                await asyncio.wait_for(self._loop.sock_connect(far, target), CALL_TIMEOUT_S)
                self.targets_connected += 1
                self._carry(client, far, out, back)
                return
            except (OSError, asyncio.TimeoutError):
                close_with_rst(client)  # a refused target: reset the client
            except asyncio.CancelledError:
                client.close()  # close(): end normally, as on_accept does
            if far is not None:
                far.close()

        if self._loop.is_closed():
            client.close()
            raise RuntimeError(f"link {self.name!r}: relay is closed")
        asyncio.run_coroutine_threadsafe(self._tracked(carry()), self._loop)

    async def _tracked(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a handshake or an accept loop as a task that `_close` cancels."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await coro
        except asyncio.CancelledError:
            pass  # close(): end quietly
        finally:
            self._handlers.discard(task)

    def _carry(
        self, client: socket.socket, far: socket.socket, out: Direction, back: Direction, first=b""
    ) -> None:
        """Hand a connected pair to the two directions' pumps; they own it from now."""
        size = max(out.socket_buffer_bytes(), back.socket_buffer_bytes())
        if size != SOCKET_BUFFER_BYTES:
            for sock in (client, far):
                with contextlib.suppress(OSError):
                    tune(sock, size)
        conn = Connection(client, far)
        out.carry(conn, client, far, first)
        back.carry(conn, far, client)

    async def _listen(
        self, initiator: str, target: tuple[str, int] | None, port: int = 0
    ) -> tuple[str, int]:
        if initiator not in self._pipes:
            raise ValueError(f"initiator must be 'a' or 'b', got {initiator!r}")
        out, back = self._pipes[initiator], self._pipes["b" if initiator == "a" else "a"]
        sock = listening_socket(port)
        sock.setblocking(False)
        self._listening.append(sock)

        async def accept() -> None:
            while True:
                try:
                    client, _ = await self._loop.sock_accept(sock)
                except OSError:
                    return  # closed
                task = self._loop.create_task(
                    self._tracked(self._handle(client, out, back, target))
                )
                self._handlers.add(task)  # until it runs and tracks itself

        self._loop.create_task(self._tracked(accept()))
        host, port = sock.getsockname()[:2]
        return host, port

    async def _handle(
        self, client: socket.socket, out: Direction, back: Direction, target: tuple[str, int] | None
    ) -> None:
        out.connections += 1
        far: socket.socket | None = None
        failed = True
        try:
            client.setblocking(False)
            set_nodelay(client)
            first = b""
            if target is None:
                target, first = await read_connect(client)
                # The request crosses the link before the far side connects.
                await out.cross()
                try:
                    far = await open_target(*target)
                except OSError:
                    raise HttpError("502 Bad Gateway") from None
                self.targets_connected += 1
                await back.cross()  # and the answer crosses back
                await self._loop.sock_sendall(client, ESTABLISHED)
            else:
                far = await open_target(*target)
                self.targets_connected += 1
            self._carry(client, far, out, back, first)
            return
        except HttpError as e:
            if e.status.startswith(("400", "403")):
                self.proxy_refused += 1
            await refuse(client, e.status)
            failed = False
        except (OSError, asyncio.TimeoutError):
            pass  # a reset, a failed side or a refused target: reset both below
        except asyncio.CancelledError:
            failed = False  # the relay is closing: close both quietly
        for sock in (client, far):
            if sock is not None:
                close_with_rst(sock) if failed else sock.close()

    async def _close(self) -> None:
        self._closed = True
        for sock in self._listening:
            sock.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def _close_pumps(self) -> None:
        if self.replay is not None:
            self.replay.close()
        for pipe in self._pipes.values():
            pipe.close()


class RelayServer:
    """Runs links on an asyncio loop in a daemon thread, for synchronous callers: a
    context manager, or `start()` and `close()`."""

    def __init__(self, processes: bool = False) -> None:
        # Each direction pumped by a process of its own (sim/pump_process.py), not a
        # thread of this one: for links past ~15 Gbit/s loaded both ways at once.
        self.processes = processes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._links: dict[str, Link] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._controls: list[ControlServer] = []

    def start(self) -> RelayServer:
        """Start the loop thread (idempotent); returns self."""
        with self._lock:
            if self._closed:
                raise RuntimeError("relay server is closed")
            if self._thread is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="isthmus-relay", daemon=True
                )
                self._thread.start()
        return self

    def add_link(self, name: str, spec: LinkSpec) -> Link:
        """A new link called ``name`` (unique, e.g. "siteA-siteB") with no listeners yet:
        add them with `add_forward` / `add_proxy`."""
        if not isinstance(spec, LinkSpec):
            raise ValueError(f"spec must be a LinkSpec, got {spec!r}")
        self.start()
        with self._lock:
            if name in self._links:
                raise ValueError(f"link name {name!r} is already used")
            assert self._loop is not None
            link = self._links[name] = Link(name, spec, self._loop, self.processes)
        link.update(spec)  # installs the impairments on the loop
        return link

    def link(self, name: str) -> Link:
        return self._links[name]

    def links(self) -> dict[str, Link]:
        """All links by name, in the order they were added."""
        with self._lock:
            return dict(self._links)

    def serve_control(self, host: str = "127.0.0.1", port: int = 0) -> ControlServer:
        """Serve the HTTP/JSON control endpoint (`GET /links`, `POST /links/NAME`) until
        `close()`, on ``host`` (loopback: whoever reaches it can change the links)."""
        server = ControlServer(self, host, port)
        with self._lock:
            self._controls.append(server)
        return server

    def close(self) -> None:
        """Close all listeners and connections and join the thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        for control in self._controls:
            control.close()
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            await asyncio.gather(*(link._close() for link in self._links.values()))

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(CALL_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CALL_TIMEOUT_S)
            loop.close()
            for link in self._links.values():
                link._close_pumps()

    def __enter__(self) -> RelayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
