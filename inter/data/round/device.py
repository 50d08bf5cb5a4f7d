"""What a round's pool threads keep per device: their own CUDA stream and the divisor.

A round's encode/decode tasks run on a pool of threads; on a GPU each thread queues its
kernels on a stream of its own (made once), and divides by a site count held as a
tensor it made on that stream. Kept apart from the round's routing (round.py) because
it is the only part that knows about CUDA streams.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from isthmus.inter.data.transport.wirecore import all_finite, sum_checked

__all__ = ["divisor", "finite", "lane_stream", "on_lane_stream", "sum_parts", "sum_raw_host"]


class _PerThread(threading.local):
    """A pool thread's own CUDA streams and site-count tensors, made on first use."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.divisors: dict[tuple[torch.device, int], torch.Tensor] = {}


_per_thread = _PerThread()
_PRIORITY = -1  # lower is more urgent; measured: 1b step's sync 2.67 s at 0, 2.48 s at -1


def lane_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own CUDA stream on ``device`` (made once), of high priority: its
    kernels are small and a round waits on each, so the GPU should schedule them
    between backward's, not after the queue of them (NCCL's streams do the same)."""
    streams = _per_thread.streams
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device, priority=_PRIORITY)
    return stream


def divisor(device: torch.device, sites: int) -> torch.Tensor:
    """The site count as an fp32 tensor on ``device``, made once per pool thread.

    A tensor, because torch divides by a Python number on CUDA as a product with its
    reciprocal, not the host's IEEE division bit for bit. Made by the thread that uses
    it, on its own lane stream (the caller's), so its stream orders the fill before
    every use; made on a round's thread it was a blocking copy on the default stream,
    queued behind all of backward's kernels, and every round waited for the GPU.
    """
    divisors = _per_thread.divisors
    t = divisors.get((device, sites))
    if t is None:
        t = divisors[(device, sites)] = torch.full(
            (), float(sites), dtype=torch.float32, device=device
        )
    return t


def finite(values: np.ndarray | torch.Tensor) -> bool:
    """No NaN or Inf in ``values`` (on the host one read pass, in C where wirecore is
    built; on a GPU one reduction and a one-byte read)."""
    if isinstance(values, np.ndarray):
        return all_finite(values)
    return bool(torch.isfinite(values).all())


@contextlib.contextmanager
def on_lane_stream(buffer: torch.Tensor) -> Iterator[None]:
    """On a GPU, runs the block on this thread's lane stream (never behind the
    training's kernels) and waits for it, so a round reads, or finish() copies back,
    complete values; on the CPU, just the block."""
    if not buffer.is_cuda:
        yield
        return
    stream = lane_stream(buffer.device)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def sum_parts(
    parts: Mapping[int, np.ndarray | torch.Tensor],
    out: np.ndarray | torch.Tensor,
    sites: int,
    average: bool,
) -> Any:
    """Sums the sites' parts of one chunk into ``out`` (host arrays, or tensors on one
    GPU, summed on this thread's current stream) and returns ``out``.

    Fixed site order: float addition is not associative, and every site must see the
    same bits. ``out`` may be the memory of part 0 or 1 (an element-wise add into its
    own input), not of a later part, which is copied first. ``average`` divides by the
    site count (on a GPU by a tensor of it: IEEE division as on the host).
    """
    if isinstance(out, np.ndarray):
        host = dict(cast("Mapping[int, np.ndarray]", parts))
        for s in range(2, sites):
            if np.may_share_memory(host[s], out):
                host[s] = host[s].copy()
        np.add(host[0], host[1], out=out)
        for s in range(2, sites):
            np.add(out, host[s], out=out)
        if average:
            np.divide(out, np.float32(sites), out=out)
        return out
    gpu = dict(cast("Mapping[int, torch.Tensor]", parts))
    stream = torch.cuda.current_stream(out.device)
    for part in gpu.values():
        # Decoded on other pool threads' streams and dropped when this returns: their
        # memory is not to be reused before this stream has read it (issue 38).
        part.record_stream(stream)
    for s in range(2, sites):
        if gpu[s].data_ptr() == out.data_ptr():
            gpu[s] = gpu[s].clone()
    torch.add(gpu[0], gpu[1], out=out)
    for s in range(2, sites):
        out.add_(gpu[s])
    if average:
        out.div_(divisor(out.device, sites))
    return out


def sum_raw_host(
    parts: Mapping[int, np.ndarray], out: np.ndarray, own: int, sites: int, average: bool
) -> tuple[int, int] | None:
    """:func:`sum_parts` of host arrays in one pass over memory, in C
    (:func:`~isthmus.inter.data.transport.wirecore.sum_checked`): the same bits, with part
    ``own`` (-1: none) checked for NaN/Inf as it is added and the result checked and
    checksummed as it is written, which a raw chunk's owner otherwise does in three
    more passes (issue 32, "fewer passes over each byte"). ``(status, crc)`` as
    ``sum_checked`` returns, or None where the C library is not loaded: the caller then
    sums with :func:`sum_parts` and checks on its own.
    """
    host = [parts[s] for s in range(sites)]
    for s, part in enumerate(host):
        exact = part.ctypes.data == out.ctypes.data and part.size == out.size
        if (np.may_share_memory(part, out) and (s >= 2 or not exact)) or part.ctypes.data % 4:
            # Only parts 0 and 1 may be out's memory, exactly; and C reads aligned fp32.
            host[s] = part.copy()
    return sum_checked(host, out, own, float(sites) if average else 0.0)
