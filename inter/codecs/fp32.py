"""The exact stage: fp32 values as their little-endian bytes."""

from __future__ import annotations

import numpy as np
import torch

from .base import check_chunk, check_size, from_le, to_host_bytes

__all__ = ["Fp32Stage"]


class Fp32Stage:
    """Exact fp32: ``4 * num_elements`` bytes per chunk (spec ``raw``)."""

    name = "raw"
    width = 4
    lossy = False

    def encoded_size(self, num_elements: int) -> int:
        """See :meth:`TensorStage.encoded_size`."""
        return 4 * num_elements

    def encode(self, chunk: torch.Tensor, key: str | None = None) -> bytes:
        """See :meth:`TensorStage.encode` (``key`` is unused: nothing is lost)."""
        return to_host_bytes(check_chunk(chunk))

    def decode(self, payload: bytes, num_elements: int) -> torch.Tensor:
        """See :meth:`TensorStage.decode`."""
        expected = self.encoded_size(num_elements)
        check_size("raw", payload, expected, num_elements)
        # Copy once so the tensor is writable and owns its memory.
        return torch.from_numpy(from_le(payload, np.float32).astype(np.float32, copy=True))
