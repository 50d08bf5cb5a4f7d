"""Byte-shuffle: group the k-th byte of every element together.

The sign/exponent bytes of gradients repeat a lot; mantissa bytes are noise. Laid out
side by side, zstd finds the repetition that interleaved bytes hide.
"""

from __future__ import annotations

import numpy as np

from isthmus.inter.data.codecs.base import CodecError

__all__ = ["ShuffleStage"]


class ShuffleStage:
    """Transposes ``width``-byte elements into byte planes (a no-op for width 1).

    Args:
        width: element width in bytes of the tensor stage before this one.
    """

    name = "shuffle"

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"shuffle width must be >= 1, got {width}")
        self.width = width

    def encode(self, data: bytes | memoryview) -> bytes | memoryview:
        """See :meth:`ByteStage.encode`; a tail shorter than one element stays as is."""
        w = self.width
        body = len(data) - len(data) % w
        if w == 1 or body == 0:
            return data
        planes = np.frombuffer(data, dtype=np.uint8, count=body).reshape(-1, w).T
        return planes.tobytes() + data[body:]

    def decode(self, data: bytes | memoryview, size: int) -> bytes | memoryview:
        """See :meth:`ByteStage.decode`."""
        if len(data) != size:
            raise CodecError(f"shuffled payload has {len(data)} bytes, expected {size}")
        w = self.width
        body = size - size % w
        if w == 1 or body == 0:
            return data
        planes = np.frombuffer(data, dtype=np.uint8, count=body).reshape(w, -1).T
        return planes.tobytes() + data[body:]
