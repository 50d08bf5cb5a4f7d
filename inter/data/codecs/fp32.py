"""The exact stage: fp32 values as their little-endian bytes."""

from __future__ import annotations

import numpy as np
import torch

from isthmus.inter.data.codecs.base import CastStage, check_chunk, check_size, from_le, to_host_view
from isthmus.inter.data.transport.wirecore import all_finite

__all__ = ["Fp32Stage"]


class Fp32Stage(CastStage):
    """Exact fp32: ``4 * num_elements`` bytes per chunk (spec ``raw``)."""

    name = "raw"
    width = 4
    lossy = False
    wire = torch.float32

    def encode(self, chunk: torch.Tensor, key: str | None = None) -> memoryview:
        # The chunk's own bytes, without a copy; ``key`` is unused: nothing is lost.
        return to_host_view(check_chunk(chunk))

    def finite(self, payload: bytes | memoryview, num_elements: int) -> bool:
        return all_finite(from_le(payload, np.float32))

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        # Copy once so the tensor is writable and owns its memory.
        return torch.from_numpy(self.decode_array(payload, num_elements).copy())

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        check_size("raw", payload, self.encoded_size(num_elements), num_elements)  # a view
        return from_le(payload, np.float32)
