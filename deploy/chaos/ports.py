"""Ports a test or a chaos scenario can name before anything listens on them.

The usual trick (bind port 0, read the port, close) hands back a port from the
kernel's ephemeral range, and that range is exactly where the kernel also picks
ports for every other ``bind(0)`` and every outgoing ``connect`` on the machine.
Between the close and the real bind, a lane server, a gRPC channel or another test
can take the same port: CI saw a Slurm job's TCPStore fail with EADDRINUSE on a
port chosen that way. A port below the ephemeral range is never picked by the
kernel, so once it is free it stays free until someone names it on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_ports"]

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
"""Below this, ports belong to well-known and registered services."""


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(word) for word in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _is_free(port: int) -> bool:
    """Whether nothing on any address holds the port (a TIME_WAIT counts as held)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n distinct ports, free on every address right now and outside the kernel's
    ephemeral range where it has room below it (see the module's docstring)."""
    low, _ = ephemeral_range()
    if low - LOWEST_PORT < 1000:  # a range moved down this far leaves no room
        return _kernel_picked(n)
    ports: list[int] = []
    for port in random.sample(range(LOWEST_PORT, low), k=min(50 * n, low - LOWEST_PORT)):
        if _is_free(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise OSError(f"found only {len(ports)} of {n} free ports in {LOWEST_PORT}-{low - 1}")


def _kernel_picked(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
