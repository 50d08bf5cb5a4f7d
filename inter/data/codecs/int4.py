"""4-bit integers, two per byte, with one scale per block of values and error feedback.

Streaming DiLoCo (arXiv 2501.18512) sends its outer gradients in 4 bits with no loss
of quality: they are averaged over H steps and feed an outer optimizer that, with
error feedback, sees every rounding error again at its next round. This stage is
int8's (:mod:`.int8`) at half the bytes: symmetric levels -7..7 of an fp32 scale per
block of ``BLOCK`` values (all scales first), the rounding error kept as the next
residual. One implementation serves CPU and CUDA tensors, so the tests on CPU run
the code a GPU runs.
"""

from __future__ import annotations

import numpy as np
import torch

from isthmus.inter.data.codecs.base import check_size, from_le
from isthmus.inter.data.codecs.int8 import Int8Stage, block_scales, expand_scales, scale_bytes

__all__ = ["Int4Stage"]

LEVELS = 7
"""Largest level: values are -7..7 times the scale (15 of the 16 nibbles; symmetric)."""
_OFFSET = 8  # stored nibble = level + 8, so 1..15 (0 never written, decoded as -8)


class Int4Stage(Int8Stage):
    """Symmetric 4-bit (-7..7) with an fp32 scale per ``BLOCK`` values and error feedback."""

    name = "int4"
    width = 1  # a byte at a time for the shuffle stage (which then does nothing)
    lossy = True
    levels = LEVELS
    wire_max = _OFFSET  # a stored nibble 0 decodes to -8
    fused = False  # the kernels write int8's format; this one packs nibbles in torch

    def encoded_size(self, num_elements: int) -> int:
        # The scales, then half a byte each.
        return scale_bytes(num_elements) + (num_elements + 1) // 2

    @staticmethod
    def _pack(q: torch.Tensor, out: torch.Tensor) -> None:
        """Two levels a byte, low nibble first, each stored as level + 8; an odd count
        pads the last byte with level 0."""
        nibbles = q.add(_OFFSET).nan_to_num_(_OFFSET).to(torch.uint8)
        if q.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), _OFFSET)])
        torch.bitwise_or(nibbles[0::2], nibbles[1::2] << 4, out=out)

    @staticmethod
    def _unpack_into(
        payload: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor
    ) -> None:
        """``out`` := (level - 8) x scale, the levels read from the payload's nibbles."""
        packed = payload[scale_bytes(n) :]
        levels = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]
        torch.mul(levels.to(torch.float32) - _OFFSET, expand_scales(scales, n), out=out)

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        check_size("int4", payload, self.encoded_size(num_elements), num_elements)
        packed = from_le(payload[scale_bytes(num_elements) :], np.uint8)
        levels = np.empty(2 * packed.size, dtype=np.float32)
        levels[0::2] = packed & 0x0F
        levels[1::2] = packed >> 4
        levels = levels[:num_elements]
        levels -= _OFFSET
        return levels * expand_scales(block_scales(payload, num_elements), num_elements)
