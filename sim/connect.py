"""HTTP CONNECT and socket helpers of the relay (:mod:`isthmus.sim.relay`).

Owns what the relay says and sets up before it splices bytes: reading and parsing a
client's CONNECT request head and the answers to it (200, or an error status and
close), the loopback check that bounds every target, and the sockets themselves:
small buffers, TCP_NODELAY, the listening socket and the connection to a target.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket

__all__ = [
    "CONNECT_TIMEOUT_S",
    "ESTABLISHED",
    "HEADER_TIMEOUT_S",
    "SOCKET_BUFFER_BYTES",
    "HttpError",
    "is_loopback",
    "listening_socket",
    "open_target",
    "parse_connect",
    "read_connect",
    "refuse",
    "set_nodelay",
    "tune",
]

SOCKET_BUFFER_BYTES = 128 * 1024
"""SO_RCVBUF/SO_SNDBUF of relay sockets (Linux doubles it): small, so the kernel does
not hide an unbounded buffer behind the link's in-flight bound."""
HEADER_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
"""The answer to a CONNECT whose target the relay reached."""


def is_loopback(host: str) -> bool:
    """Whether `host` is `localhost` or a loopback address literal (no DNS lookup)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HttpError(Exception):
    """A CONNECT request the relay answers with `status` (e.g. "403 Forbidden") and closes."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


def parse_connect(header: bytes) -> tuple[str, int]:
    """Parse an HTTP CONNECT request head; raise `HttpError` on a bad or forbidden one."""
    try:
        method, authority, version = header.split(b"\r\n", 1)[0].decode("ascii").split(" ")
        host, _, port_text = authority.rpartition(":")
        port = int(port_text)
    except (UnicodeDecodeError, ValueError) as e:
        raise HttpError("400 Bad Request") from e
    if method != "CONNECT" or not version.startswith("HTTP/1.") or not host or not 0 < port < 65536:
        raise HttpError("400 Bad Request")
    if not is_loopback(host):
        raise HttpError("403 Forbidden")
    return host.strip("[]"), port


async def read_connect(reader: asyncio.StreamReader) -> tuple[str, int]:
    """Read a CONNECT request head (within `HEADER_TIMEOUT_S`) and return its target.

    Raises:
        HttpError: a bad, oversized or forbidden request.
    """
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
    except asyncio.LimitOverrunError:
        raise HttpError("400 Bad Request") from None
    return parse_connect(head)


async def refuse(writer: asyncio.StreamWriter, status: str) -> None:
    """Answer a CONNECT with an error `status`; the caller closes the connection."""
    writer.write(f"HTTP/1.1 {status}\r\nConnection: close\r\n\r\n".encode())
    with contextlib.suppress(OSError):
        await writer.drain()


def tune(sock: socket.socket) -> None:
    """Give `sock` the relay's small buffers (`SOCKET_BUFFER_BYTES`)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)


def set_nodelay(sock: socket.socket) -> None:
    """Turn Nagle's algorithm off: small writes go out at once (delay is the link's to add)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listening_socket(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (at `port`, 0 = the OS picks), with small buffers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune(sock)  # accepted sockets inherit the buffer sizes
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


async def open_target(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a loopback target with small socket buffers (set before the handshake)."""
    assert is_loopback(host), host  # callers check; this is the last line of defence
    candidates = ["127.0.0.1", "::1"] if host.lower() == "localhost" else [host]
    loop = asyncio.get_running_loop()
    error: OSError = OSError(f"cannot connect to {host}:{port}")
    for ip in candidates:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            tune(sock)
            set_nodelay(sock)
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (ip, port)), CONNECT_TIMEOUT_S)
            return await asyncio.open_connection(sock=sock)
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            error = e if isinstance(e, OSError) else OSError(f"timeout connecting to {ip}:{port}")
    raise error
