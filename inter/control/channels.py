"""gRPC channels of the control plane: between coordinators, and from ranks to theirs."""

from __future__ import annotations

from concurrent import futures

import grpc

from isthmus.inter.security import INSECURE, SiteSecurity

MAX_MESSAGE_BYTES = 1 << 20  # control messages are small; refuse anything larger
IDLE_CLOSE_MS = 300_000
"""A server closes a connection that carried no call for this long (issue 14: idle
connections are a resource anyone who reaches a port could otherwise pile up; a
peer's channel reconnects by itself when it next calls)."""


def server_options(options: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Every isthmus gRPC server's options: ``options`` plus the idle-connection limit,
    and no ``SO_REUSEPORT``: gRPC sets it by default, and a second server then binds a
    live coordinator's port beside it (issue 63) and takes half its connections."""
    return [*options, ("grpc.max_connection_idle_ms", IDLE_CLOSE_MS), ("grpc.so_reuseport", 0)]


def bind_failure(address: str) -> str:
    """Why ``address`` ("host:port") cannot be bound, in words ("address already in
    use"), for the one line a server that gRPC could not bind raises: gRPC itself says
    only that the port is 0."""
    import socket

    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host.strip("[]") or "0.0.0.0", int(port)))
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    except ValueError:
        return f"not a host:port: {address!r}"
    return "gRPC refused it"


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


def control_server(workers: int, name: str, interceptors: list) -> grpc.Server:
    """A control-plane gRPC server: ``workers`` handler threads named ``name``-N."""
    pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    return grpc.server(pool, options=server_options(MESSAGE_LIMITS), interceptors=interceptors)


def add_port(server: grpc.Server, security: SiteSecurity, address: str, who: str) -> int:
    """Binds ``address`` on ``server`` as ``security`` says; the port, or an ``OSError``
    that says why ``who`` could not bind it."""
    bound = security.add_port(server, address)
    if bound == 0:
        raise OSError(f"{who} could not bind {address}: {bind_failure(address)}")
    return bound
