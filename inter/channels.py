"""gRPC channels of the control plane: between coordinators, and from ranks to theirs."""

from __future__ import annotations

import grpc

from isthmus.inter.security import INSECURE, SiteSecurity

MAX_MESSAGE_BYTES = 1 << 20  # control messages are small; refuse anything larger
MESSAGE_LIMITS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def peer_channel(
    address: str, proxy: str | None = None, security: SiteSecurity | None = None
) -> grpc.Channel:
    """A channel to `address`, through an HTTP CONNECT proxy when given; mutual TLS
    and the job token as `security` says (None = plaintext)."""
    options = list(MESSAGE_LIMITS)
    if proxy:
        options.append(("grpc.http_proxy", proxy))
    return (security or INSECURE).channel(address, options)
