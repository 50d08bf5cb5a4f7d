"""bfloat16 cast: half the bytes of fp32, round-to-nearest-even, no error feedback."""

from __future__ import annotations

import numpy as np
import torch

from isthmus.inter.data.codecs.base import CastStage, check_chunk, check_size, from_le, to_host_view

__all__ = ["Bf16Stage"]

_EXPONENT = np.uint16(0x7F80)
"""A bf16's exponent bits: all set is Inf or NaN."""


class Bf16Stage(CastStage):
    """fp32 → bf16 on the chunk's device, so a GPU copies half the bytes to the host."""

    name = "bf16"
    width = 2
    lossy = True
    wire = torch.bfloat16  # widening it back is exact

    def encode(self, chunk: torch.Tensor, key: str | None = None) -> memoryview:
        return to_host_view(check_chunk(chunk).to(torch.bfloat16))

    def finite(self, payload: bytes | memoryview, num_elements: int) -> bool:
        # No value with every exponent bit set.
        exponent = from_le(payload, np.uint16) & _EXPONENT
        return not bool((exponent == _EXPONENT).any())

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        return torch.from_numpy(self.decode_array(payload, num_elements))

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        check_size("bf16", payload, self.encoded_size(num_elements), num_elements)
        # bf16 is the top half of fp32: widening is exact and needs no rounding.
        bits = from_le(payload, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
