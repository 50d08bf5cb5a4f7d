"""The buffers a rank's gradient rounds run in: a copy of each group's shard, which the
round reads and writes while the shard itself changes only when the step commits
(:class:`~isthmus.inter.data.sync.gradient.LaneGradientSync`)."""

from __future__ import annotations

from concurrent import futures

import torch

__all__ = ["GroupBuffers"]


class GroupBuffers:
    """Hands each group's round its buffer, reusing a CPU group's from two steps before.

    A new host buffer costs more than the copy into it: the kernel faults its pages in
    and zeroes them (8 groups of 256 MiB spent 1.1 of a 1.8 s step there,
    docs/benchmarks/lanes.md). Two steps, not one: a raw chunk is sent from the buffer
    itself, and the outbox keeps the previous step's chunks for a peer that asks again.
    Only a buffer whose round succeeded is reused: a failed round's threads may still
    write into it. CUDA buffers come from torch's caching allocator as they are.
    """

    def __init__(self) -> None:
        # (group, step parity) -> the step that last used the buffer, it, and its round.
        self._slots: dict[tuple[int, int], tuple[int, torch.Tensor, futures.Future]] = {}

    def copy_of(self, step: int, group: int, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` as a flat fp32 buffer of its own (on the caller's stream on a GPU);
        never one a round of this step or the last had (a RETRY asks again in its step)."""
        flat = shard.detach().reshape(-1)
        if flat.is_cuda:
            return flat.to(torch.float32, copy=True)
        last = self._slots.get((group, step % 2))
        if last is not None:
            last_step, buffer, round_ = last
            if (
                last_step <= step - 2
                and buffer.numel() == flat.numel()
                and round_.done()
                and not round_.cancelled()
                and round_.exception() is None
            ):
                return buffer.copy_(flat)
        return flat.to(torch.float32, copy=True)

    def started(self, step: int, group: int, buffer: torch.Tensor, round_: futures.Future) -> None:
        if not buffer.is_cuda:
            self._slots[(group, step % 2)] = (step, buffer, round_)
