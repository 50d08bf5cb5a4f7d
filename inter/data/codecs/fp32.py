"""The exact stage: fp32 values as their little-endian bytes."""

from __future__ import annotations

import numpy as np
import torch

from isthmus.inter.data.codecs.base import check_chunk, check_size, from_le, to_device, to_host_view
from isthmus.inter.data.transport.wirecore import all_finite

__all__ = ["Fp32Stage"]


class Fp32Stage:
    """Exact fp32: ``4 * num_elements`` bytes per chunk (spec ``raw``)."""

    name = "raw"
    width = 4
    lossy = False

    def encoded_size(self, num_elements: int) -> int:
        """See :meth:`TensorStage.encoded_size`."""
        return 4 * num_elements

    def encode(self, chunk: torch.Tensor, key: str | None = None) -> memoryview:
        """See :meth:`TensorStage.encode` (``key`` is unused: nothing is lost).

        The chunk's own bytes, without a copy (a CUDA chunk: this thread's pinned copy).
        """
        return to_host_view(check_chunk(chunk))

    def finite(self, payload: bytes | memoryview, num_elements: int) -> bool:
        """See :meth:`TensorStage.finite` (one pass over the values)."""
        return all_finite(from_le(payload, np.float32))

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        """See :meth:`TensorStage.decode`."""
        # Copy once so the tensor is writable and owns its memory.
        return torch.from_numpy(self.decode_array(payload, num_elements).copy())

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        """See :meth:`TensorStage.decode_array`: a view of ``payload``, no copy."""
        expected = self.encoded_size(num_elements)
        check_size("raw", payload, expected, num_elements)
        return from_le(payload, np.float32)

    def decode_device(
        self, payload: bytes | memoryview, num_elements: int, device: torch.device
    ) -> torch.Tensor:
        """See :meth:`TensorStage.decode_device`."""
        check_size("raw", payload, self.encoded_size(num_elements), num_elements)
        return to_device(payload, device).view(torch.float32)
