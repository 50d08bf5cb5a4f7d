"""gRPC channels of the control plane: between coordinators, and from ranks to theirs."""

from __future__ import annotations

import grpc

from isthmus.inter.security import INSECURE, SiteSecurity

MAX_MESSAGE_BYTES = 1 << 20  # control messages are small; refuse anything larger
IDLE_CLOSE_MS = 300_000
"""A server closes a connection that carried no call for this long (issue 14: idle
connections are a resource anyone who reaches a port could otherwise pile up; a
peer's channel reconnects by itself when it next calls)."""


def server_options(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Every isthmus gRPC server's options: ``options`` plus the idle-connection limit."""
    return [*options, ("grpc.max_connection_idle_ms", IDLE_CLOSE_MS)]


MESSAGE_LIMITS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def peer_channel(
    address: str, proxy: str | None = None, security: SiteSecurity | None = None
) -> grpc.Channel:
    """A channel to `address`, through an HTTP CONNECT proxy when given; mutual TLS
    and the job token as `security` says (None = plaintext)."""
    options: list[tuple[str, int | str]] = list(MESSAGE_LIMITS)
    if proxy:
        options.append(("grpc.http_proxy", proxy))
    return (security or INSECURE).channel(address, options)
