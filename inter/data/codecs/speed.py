"""Each codec's encode and decode speed on one core, and the cores a link's rate needs
of it: what tells, beside an all-reduce benchmark's figures, whether the CPU rather than
the link is the limit (`isthmus bench allreduce` prints it before its cases)."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["MIB", "codec_throughput", "format_throughput"]

MIB = 1 << 20


def codec_throughput(spec: str, mib: float = 4.0, repeat: int = 3) -> dict[str, Any]:
    """Encode and decode speed of one codec on one core (1 torch thread) in fp32 MB per
    second, best of ``repeat`` runs over ``mib`` MiB of gradient-like values, and its
    ``ratio``."""
    from isthmus.inter.data.codecs.chain import make_codec

    codec = make_codec(spec)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = int(mib * MIB) // 4
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
        enc = dec = float("inf")
        payload: bytes | memoryview = b""
        for _ in range(repeat):
            t0 = time.perf_counter()
            payload = codec.encode(x, "bench")
            t1 = time.perf_counter()
            codec.decode(payload, n)
            t2 = time.perf_counter()
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    finally:
        torch.set_num_threads(threads)
    return {
        "codec": codec.name,
        "encode_mb_s": n * 4 / enc / 1e6,
        "decode_mb_s": n * 4 / dec / 1e6,
        "ratio": n * 4 / len(payload),
    }


def format_throughput(rows: list[dict[str, Any]], gbits: list[float]) -> str:
    """A table of per-core codec speed and the cores each link speed needs (at line rate
    a site encodes and decodes ``bandwidth x ratio`` of fp32 per second)."""
    head = f"{'codec':<22}{'enc MB/s/core':>14}{'dec MB/s/core':>14}{'ratio':>7}"
    head += "".join(f"{f'cores@{g:g}G':>11}" for g in gbits)
    lines = [head]
    for r in rows:
        line = (
            f"{r['codec']:<22}{r['encode_mb_s']:>14.0f}{r['decode_mb_s']:>14.0f}{r['ratio']:>7.2f}"
        )
        for g in gbits:
            fp32_rate = g * 1e9 / 8 * r["ratio"] / 1e6  # MB/s of fp32 at line rate
            cores = fp32_rate / r["encode_mb_s"] + fp32_rate / r["decode_mb_s"]
            line += f"{cores:>11.1f}"
        lines.append(line)
    return "\n".join(lines)
