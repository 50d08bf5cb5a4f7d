"""How a lane cuts its transfers for a link: the chunk size, how many TCP connections
per peer, and the bounds that follow from them (the connections a lane admits from each
site, the descriptors a rank needs). Without torch or gRPC: the job config resolves them
in the CLI before any process imports torch."""

from __future__ import annotations

import math
import resource
from pathlib import Path

__all__ = [
    "CUDA_BULK_CHUNK_BYTES",
    "BULK_MAX_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "UNEQUAL_CUDA_CHUNK_BYTES",
    "MAX_CONNECTIONS",
    "PER_SITE_CONNECTIONS",
    "chunk_bytes_for_link",
    "connections_for_link",
    "descriptors_needed",
    "raise_descriptor_limit",
    "sync_chunk_bytes",
    "tcp_receive_window",
]

MIN_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024
CUDA_BULK_CHUNK_BYTES = 16 << 20
"""The least chunk of a CUDA tensor on the bulk port (see :func:`sync_chunk_bytes`)."""
BULK_MAX_CHUNK_BYTES = 16 << 20
"""The largest chunk sized from the link on the bulk port, which has no gRPC message
limit (see :func:`sync_chunk_bytes`)."""
UNEQUAL_CUDA_CHUNK_BYTES = 64 << 20
"""The least chunk of a CUDA tensor when sites differ in rank count."""
MAX_CONNECTIONS = 16
"""Connections per peer lane at most (``sync.connections``)."""
PER_SITE_CONNECTIONS = 2 * MAX_CONNECTIONS
"""Bulk connections a lane admits from one site at once: a peer opens at most
MAX_CONNECTIONS and dials again one it left stalled while the old one's frame times
out, so twice the most any valid job opens. Per site, not per lane: a fixed 64 for the
whole lane once deadlocked 6 sites x 16 connections at step 0 (issue 61)."""
DESCRIPTORS_BESIDES_LANES = 512
"""Descriptors a rank holds apart from its lane's connections: libraries, gloo's and
gRPC's sockets, logs, the checkpoint being written (a 2 x 2 CPU job's rank holds ~150)."""
_DEFAULT_RMEM_MAX = 6 << 20  # Linux's default tcp_rmem maximum


def chunk_bytes_for_link(
    bandwidth_bps: float, rtt_s: float, most_bytes: int = MAX_CHUNK_BYTES
) -> int:
    """Chunk size for a link: its bandwidth-delay product, clamped to 256 KiB up to
    ``most_bytes`` (4 MiB unless the caller says).

    A chunk about one BDP keeps a window's worth of data in one message: smaller
    chunks pay gRPC's per-message cost (python gRPC wants 256 KiB-4 MiB messages),
    larger ones delay the owner's first reduction and hold more memory per stream.
    Returns the largest power of two not above the BDP, within the clamp (the bulk port,
    without gRPC's limit, passes :data:`BULK_MAX_CHUNK_BYTES`).
    """
    if bandwidth_bps <= 0 or rtt_s < 0:
        raise ValueError(f"need bandwidth > 0 and rtt >= 0, got {bandwidth_bps}, {rtt_s}")
    bdp = bandwidth_bps / 8 * rtt_s
    size = MIN_CHUNK_BYTES
    while size * 2 <= min(bdp, most_bytes):
        size *= 2
    return size


def sync_chunk_bytes(
    bandwidth_bps: float, rtt_s: float, *, cuda: bool, bulk: bool, unequal_sites: bool = False
) -> int:
    """The chunk size training uses (and so ``isthmus bench allreduce``): the link's
    :func:`chunk_bytes_for_link`, up to 16 MiB on the bulk port (gRPC's 4 MiB message
    limit does not apply there), and raised for CUDA tensors on the bulk port.

    Per chunk a lane pays a frame, an acknowledgement and a hand-over between threads:
    one lane of CPU tensors filled 78-79 % of an emulated 1000 km link at 25 Gbit/s with
    4 MiB chunks and 83-88 % with 16 MiB ones (docs/benchmarks/wan-emulator.md). A CUDA
    chunk costs a dozen kernel launches under the GIL the lane's threads share: at 4 MiB
    the launches bounded the sync (issue 11: the 1b gradient over 2 lanes took 1.92 s at
    4 MiB, 1.05 s at 16 MiB). A rank of the smaller site carries
    as many more bytes as its site has fewer ranks, in one process: 1b on 2 + 1 H100s
    went from 74.8 % to 94.4 % of the sites' standalone sum at 64 MiB
    (docs/benchmarks/unequal-sites.md, "Sites of different sizes").
    """
    size = chunk_bytes_for_link(
        bandwidth_bps, rtt_s, BULK_MAX_CHUNK_BYTES if bulk else MAX_CHUNK_BYTES
    )
    if bulk and cuda:
        size = max(size, CUDA_BULK_CHUNK_BYTES)
        if unequal_sites:
            size = max(size, UNEQUAL_CUDA_CHUNK_BYTES)
    return size


def tcp_receive_window(path: str = "/proc/sys/net/ipv4/tcp_rmem") -> int:
    """The most bytes one TCP connection of this host keeps in flight toward it: half
    the kernel's largest autotuned receive buffer (the other half is its overhead, as
    ``tcp_adv_win_scale`` = 1 has it). 3 MiB where the file cannot be read."""
    try:
        rmem_max = int(Path(path).read_text().split()[2])
    except (OSError, ValueError, IndexError):
        rmem_max = _DEFAULT_RMEM_MAX
    return max(64 << 10, rmem_max // 2)


def connections_for_link(
    bandwidth_bps: float, rtt_s: float, per_flow_bps: float = 0.0, window_bytes: int = 0
) -> int:
    """TCP connections per peer lane that fill a link, 2-16.

    One connection carries at most one receive window per round trip, and a link may
    cap each flow (public clouds do: AWS holds one flow to 5 Gbit/s); so as many as the
    larger of bandwidth / per-flow cap and bandwidth-delay product / window, at least 2
    (a connection that waits for its acknowledgements leaves the other sending).
    ``per_flow_bps`` 0: no cap; ``window_bytes`` 0: :func:`tcp_receive_window`.
    """
    if bandwidth_bps <= 0 or rtt_s < 0 or per_flow_bps < 0:
        raise ValueError(
            f"need bandwidth > 0, rtt >= 0, per-flow cap >= 0, got "
            f"{bandwidth_bps}, {rtt_s}, {per_flow_bps}"
        )
    window = window_bytes or tcp_receive_window()
    by_cap = math.ceil(bandwidth_bps / per_flow_bps) if per_flow_bps else 1
    by_window = math.ceil(bandwidth_bps / 8 * rtt_s / window)
    return max(2, min(MAX_CONNECTIONS, max(by_cap, by_window)))


def descriptors_needed(peers: int, connections: int) -> int:
    """File descriptors one rank may hold in a job of ``peers`` other sites: its
    ``connections`` to each, the PER_SITE_CONNECTIONS each may open to it, and the rest
    (DESCRIPTORS_BESIDES_LANES)."""
    return peers * (connections + PER_SITE_CONNECTIONS) + DESCRIPTORS_BESIDES_LANES


def raise_descriptor_limit(needed: int) -> None:
    """Raises this process's soft limit on open files to ``needed`` when it is lower
    (the hard limit allowing): a lane out of descriptors refuses its peers' connections
    in the middle of a round. Raises OSError naming both figures when it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise OSError(
            f"this rank may need {needed} open files (its lane's connections to and from "
            f"every other site) and the hard limit is {hard}: raise it (ulimit -Hn, "
            "LimitNOFILE=, a container's nofile), or use fewer sync.connections"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
