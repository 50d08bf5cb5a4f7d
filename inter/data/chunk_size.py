"""How big a lane's chunks are for a link, without torch or gRPC (the job config
resolves it in the CLI before any process imports torch)."""

from __future__ import annotations

__all__ = ["MAX_CHUNK_BYTES", "MIN_CHUNK_BYTES", "chunk_bytes_for_link"]

MIN_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024


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
