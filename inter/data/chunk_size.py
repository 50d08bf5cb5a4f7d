"""How big a lane's chunks are for a link, without torch or gRPC (the job config
resolves it in the CLI before any process imports torch)."""

from __future__ import annotations

__all__ = [
    "CUDA_BULK_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "UNEQUAL_CUDA_CHUNK_BYTES",
    "chunk_bytes_for_link",
    "sync_chunk_bytes",
]

MIN_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024
CUDA_BULK_CHUNK_BYTES = 16 << 20
"""The least chunk of a CUDA tensor on the bulk port (see :func:`sync_chunk_bytes`)."""
UNEQUAL_CUDA_CHUNK_BYTES = 64 << 20
"""The least chunk of a CUDA tensor when sites differ in rank count."""


def chunk_bytes_for_link(bandwidth_bps: float, rtt_s: float) -> int:
    """Chunk size for a link: its bandwidth-delay product, clamped to 256 KiB-4 MiB.

    A chunk about one BDP keeps a window's worth of data in one message: smaller
    chunks pay gRPC's per-message cost (python gRPC wants 256 KiB-4 MiB messages),
    larger ones delay the owner's first reduction and hold more memory per stream.

    Args:
        bandwidth_bps: link bandwidth in bits per second, one direction.
        rtt_s: round-trip time in seconds.
    Returns:
        A power of two in bytes, the largest not above the BDP, within the clamp.
    """
    if bandwidth_bps <= 0 or rtt_s < 0:
        raise ValueError(f"need bandwidth > 0 and rtt >= 0, got {bandwidth_bps}, {rtt_s}")
    bdp = bandwidth_bps / 8 * rtt_s
    size = MIN_CHUNK_BYTES
    while size * 2 <= min(bdp, MAX_CHUNK_BYTES):
        size *= 2
    return size


def sync_chunk_bytes(
    bandwidth_bps: float, rtt_s: float, *, cuda: bool, bulk: bool, unequal_sites: bool = False
) -> int:
    """The chunk size training uses (and so ``isthmus bench allreduce``): the link's
    :func:`chunk_bytes_for_link`, raised for CUDA tensors on the bulk port.

    A CUDA chunk costs a dozen kernel launches, each under the GIL that the lane's
    threads share, and gRPC's message limit does not apply to the bulk port: at 4 MiB
    the launches, not the link, bounded the sync (issue 11: the 1b gradient over 2
    lanes took 1.92 s at 4 MiB, 1.05 s at 16 MiB). A rank of the smaller site carries
    as many more bytes as its site has fewer ranks, in one process: 1b on 2 + 1 H100s
    went from 74.8 % to 94.4 % of the sites' standalone sum at 64 MiB
    (docs/benchmarks.md, "Sites of different sizes").
    """
    size = chunk_bytes_for_link(bandwidth_bps, rtt_s)
    if bulk and cuda:
        size = max(size, CUDA_BULK_CHUNK_BYTES)
        if unequal_sites:
            size = max(size, UNEQUAL_CUDA_CHUNK_BYTES)
    return size
