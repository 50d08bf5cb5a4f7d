"""HTTP CONNECT and socket helpers of the relay (:mod:`isthmus.sim.relay`).

Owns what the relay says and sets up before it splices bytes: reading and parsing a
client's CONNECT request head and the answers to it (200, or an error status and
close), the loopback check that bounds every target, and the sockets themselves:
small buffers, TCP_NODELAY, the listening socket and the connection to a target."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct

__all__ = [
    "CONNECT_TIMEOUT_S",
    "ESTABLISHED",
    "HEADER_TIMEOUT_S",
    "FAST_BUFFER_BYTES",
    "SOCKET_BUFFER_BYTES",
    "HttpError",
    "close_with_rst",
    "is_loopback",
    "listening_socket",
    "open_target",
    "parse_connect",
    "read_connect",
    "refuse",
    "reset_on_close",
    "set_nodelay",
    "tune",
]

SOCKET_BUFFER_BYTES = 128 * 1024
"""SO_RCVBUF/SO_SNDBUF of relay sockets (Linux doubles it): small, so the kernel does
not hide an unbounded buffer behind the link's in-flight bound. A fast link's
connections get up to `FAST_BUFFER_BYTES` (`DirectionPipe.socket_buffer_bytes`): each
splice moves at most what one socket buffer holds, and at 25 Gbit/s 256 KiB lasts
80 us."""
FAST_BUFFER_BYTES = 4 << 20
HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 * 1024
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


async def read_connect(sock: socket.socket) -> tuple[tuple[str, int], bytes]:
    """Read a CONNECT request head from a non-blocking socket (within
    `HEADER_TIMEOUT_S`): the target, and any bytes the client sent after the head (to
    carry first). HttpError on a bad, oversized or forbidden request."""
    loop = asyncio.get_running_loop()
    head = b""
    deadline = loop.time() + HEADER_TIMEOUT_S
    while b"\r\n\r\n" not in head:
        if len(head) > MAX_HEADER_BYTES:
            raise HttpError("400 Bad Request")
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 4096), deadline - loop.time())
        except asyncio.TimeoutError:
            raise OSError("no complete CONNECT request in time") from None
        if not data:
            raise OSError("the client closed before its CONNECT request was complete")
        head += data
    head, _, rest = head.partition(b"\r\n\r\n")
    return parse_connect(head + b"\r\n\r\n"), rest


async def refuse(sock: socket.socket, status: str) -> None:
    """Answer a CONNECT with an error `status`; the caller closes the connection."""
    data = f"HTTP/1.1 {status}\r\nConnection: close\r\n\r\n".encode()
    with contextlib.suppress(OSError):
        await asyncio.get_running_loop().sock_sendall(sock, data)


def tune(sock: socket.socket, nbytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Give `sock` the relay's small buffers (`SOCKET_BUFFER_BYTES` unless told)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)


def reset_on_close(sock: socket.socket) -> None:
    """Linger 0: the socket's last close sends RST, as behind a failing middlebox."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def close_with_rst(sock: socket.socket) -> None:
    reset_on_close(sock)
    sock.close()


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


async def open_target(host: str, port: int) -> socket.socket:
    """Connect to a loopback target, non-blocking, with small socket buffers (set before
    the handshake)."""
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
            return sock
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            error = e if isinstance(e, OSError) else OSError(f"timeout connecting to {ip}:{port}")
    raise error
