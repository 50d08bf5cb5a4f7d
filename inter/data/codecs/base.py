"""What every codec stage shares: the error type, the checksum, the host copy.

Payloads come from another site, so every decode treats its input as hostile: sizes
are checked before anything is allocated (docs/design.md, invariant 4).
"""

from __future__ import annotations

import sys
import threading
from typing import Protocol

import crc32c as _crc32c
import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "ByteStage",
    "CastStage",
    "CodecError",
    "NonFiniteEncoding",
    "TensorStage",
    "check_chunk",
    "check_size",
    "crc32",
    "to_host_bytes",
    "to_device",
    "to_host_view",
]

# numpy has no bfloat16: a tensor goes to bytes through the integer type of its width.
_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


class _PinnedBuffers(threading.local):
    """Each thread's one growing pinned buffer per dtype (cudaHostAlloc is slow)."""

    def __init__(self) -> None:
        self.by_dtype: dict[torch.dtype, torch.Tensor] = {}


_pinned = _PinnedBuffers()


class CodecError(ValueError):
    """A payload could not be decoded (wrong size, corrupt or hostile frame)."""


class NonFiniteEncoding(ValueError):
    """An encoded payload holds NaN or Inf (``CodecChain.encode(..., require_finite=True)``):
    from a finite chunk that is a bug of the encode, never a value to send."""


def crc32(payload: bytes | bytearray | memoryview) -> int:
    """The CRC-32C of ``payload``: CPUs compute it in hardware (~20 GB/s against ~3 for
    zlib's CRC-32, which cost a lane more than copying its bytes), and the ``crc32c``
    package releases the GIL on large buffers, so pool threads overlap."""
    return _crc32c.crc32c(payload)


def check_chunk(chunk: torch.Tensor) -> torch.Tensor:
    """Returns ``chunk`` detached and contiguous, or raises ValueError if not 1-D fp32."""
    if chunk.dim() != 1 or chunk.dtype != torch.float32:
        raise ValueError(
            f"codec input must be a 1-D float32 tensor, got {tuple(chunk.shape)} "
            f"{chunk.dtype} on {chunk.device}"
        )
    return chunk.detach().contiguous()


def check_size(stage: str, payload: bytes | memoryview, expected: int, num_elements: int) -> None:
    """Raises CodecError unless ``payload`` is exactly ``expected`` bytes long."""
    if num_elements < 0 or len(payload) != expected:
        raise CodecError(
            f"{stage} payload has {len(payload)} bytes, expected {expected} "
            f"for {num_elements} elements"
        )


def _pinned_buffer(dtype: torch.dtype, numel: int) -> torch.Tensor:
    cache = _pinned.by_dtype
    buf = cache.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 20), dtype=dtype, pin_memory=True)
        cache[dtype] = buf
    return buf[:numel]


def to_host_bytes(t: torch.Tensor) -> bytes:
    """A 1-D tensor's elements (a 1-, 2- or 4-byte dtype, any device) as little-endian
    host bytes. A CUDA tensor is copied into pinned memory first (a blocking copy on
    the current stream, so the bytes are complete when it returns)."""
    array = _host_tensor(t).view(_AS_INT[t.element_size()]).numpy()
    # Only a big-endian host pays for a byte swap; the wire is little-endian.
    return (array if sys.byteorder == "little" else array.byteswap()).tobytes()


def _host_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous on the host: itself on CPU; a CUDA tensor in pinned memory of
    its own (a blocking copy on the current stream). Its own, so a lane sends the
    payload from there with no copy into a message; torch's caching host allocator
    hands the memory out again once nothing refers to it (no cudaHostAlloc a chunk)."""
    t = t.detach().contiguous()
    if t.device.type == "cuda":
        host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        return host
    return t if t.device.type == "cpu" else t.cpu()


def to_host_view(t: torch.Tensor) -> memoryview:
    """The 1-D tensor's elements as little-endian host bytes, copied only if need be.

    A CPU tensor's own memory is returned as a read-only view: valid while the tensor
    is unchanged. A CUDA tensor is copied into pinned memory that the view alone holds
    (blocking): valid as long as the view is kept.
    """
    if sys.byteorder != "little":
        return memoryview(to_host_bytes(t))
    array = _host_tensor(t).view(_AS_INT[t.element_size()]).numpy()
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12.
    return memoryview(array).cast("B").toreadonly()  # type: ignore[arg-type]


def to_device(payload: bytes | memoryview, device: torch.device) -> torch.Tensor:
    """Copies ``payload`` to a new uint8 tensor on ``device`` through this thread's
    pinned buffer (a blocking copy on the current stream: the buffer is free after)."""
    size = len(payload)
    if torch.device(device).type == "cpu":  # a copy, so the tensor owns its memory
        return torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
    staging = _pinned_buffer(torch.uint8, size)
    np.copyto(staging.numpy(), np.frombuffer(payload, dtype=np.uint8))
    out = torch.empty(size, dtype=torch.uint8, device=device)
    out.copy_(staging)
    return out


def from_le(payload: bytes | memoryview, dtype: npt.DTypeLike) -> np.ndarray:
    """A read-only view of little-endian ``payload`` as ``dtype`` (native order)."""
    array = np.frombuffer(payload, dtype=np.dtype(dtype).newbyteorder("<"))
    return array if sys.byteorder == "little" else array.astype(np.dtype(dtype))


class TensorStage(Protocol):
    """Turns fp32 values into bytes and back; the first stage of every chain."""

    name: str
    width: int  # bytes per element on the wire (what byte-shuffle groups by)
    lossy: bool

    def encoded_size(self, num_elements: int) -> int: ...

    def encode(self, chunk: torch.Tensor, key: str | None) -> bytes | memoryview:
        """Encodes a 1-D fp32 chunk on its device; ``key`` names error-feedback state.
        May return a view of ``chunk``'s memory (valid until the chunk changes) or of
        pinned memory of its own (:func:`to_host_view`)."""
        ...

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        """Decodes to a new writable 1-D fp32 CPU tensor; raises CodecError."""
        ...

    def finite(self, payload: bytes | memoryview, num_elements: int) -> bool:
        """Whether every value ``payload`` decodes to is finite, read off the host bytes
        as cheaply as the format allows (int8 and int4: their block scales alone)."""
        ...

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        """Decodes to 1-D native fp32 values, possibly a read-only view of ``payload``
        (no copy where the wire already holds fp32); raises CodecError."""
        ...

    def decode_device(
        self, payload: bytes | memoryview, num_elements: int, device: torch.device
    ) -> torch.Tensor:
        """Decodes on ``device``: only the encoded bytes cross to it (a CUDA lane's
        sums and results never pass through host fp32). Same values, bit for bit, as
        :meth:`decode` (one IEEE operation per element either way); raises CodecError."""
        ...


class CastStage:
    """What a stage that sends each value as one ``wire`` element shares."""

    name: str
    width: int
    wire: torch.dtype

    def encoded_size(self, num_elements: int) -> int:
        return self.width * num_elements

    def decode_device(
        self, payload: bytes | memoryview, num_elements: int, device: torch.device
    ) -> torch.Tensor:
        check_size(self.name, payload, self.encoded_size(num_elements), num_elements)
        return to_device(payload, device).view(self.wire).to(torch.float32)


class ByteStage(Protocol):
    """Transforms bytes and back; chained after the tensor stage."""

    name: str

    def encode(self, data: bytes | memoryview) -> bytes | memoryview:
        """Transforms ``data`` (the tensor stage's output may be a view)."""
        ...

    def decode(self, data: bytes | memoryview, size: int) -> bytes | memoryview:
        """Inverts ``encode``; ``size`` is the exact length the result must have."""
        ...
