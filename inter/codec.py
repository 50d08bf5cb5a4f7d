"""Codecs: turn a 1-D fp32 CPU chunk into bytes for the wire, and back.

A codec is a small object with a ``name`` (the string every site must agree on, sent
in each ``PushChunksRequest``), ``encode`` and ``decode``. The design is a chain:
a *tensor stage* that turns fp32 values into bytes (today only the exact fp32
serialization of :class:`RawCodec`; later bf16, int8 with error feedback) followed
by zero or more *byte stages* (today zstd; later byte-shuffle). ``make_codec`` is
the single parser of codec specs, so adding a stage means adding a class and a
branch there.

Every decode treats its input as hostile: payloads come from another site, so sizes
are checked before anything is allocated (DESIGN.md, invariant 4).
"""

from __future__ import annotations

import sys
import threading
import zlib
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import zstandard

__all__ = [
    "Codec",
    "CodecError",
    "RawCodec",
    "ZstdCodec",
    "crc32",
    "make_codec",
    "ALLOWED_SPECS",
]

ALLOWED_SPECS = '"raw", "zstd", "zstd:LEVEL" (LEVEL an integer from -7 to 22)'
_FP32 = np.dtype("<f4")  # the wire is little-endian whatever the host is


class CodecError(ValueError):
    """A payload could not be decoded (wrong size, corrupt or hostile frame)."""


@runtime_checkable
class Codec(Protocol):
    """Encodes a 1-D fp32 CPU tensor to bytes and decodes it back."""

    name: str

    def encode(self, chunk: torch.Tensor) -> bytes:
        """Encodes one chunk.

        Args:
            chunk: 1-D float32 CPU tensor.
        Returns:
            The payload bytes.
        """
        ...

    def decode(self, payload: bytes, num_elements: int) -> torch.Tensor:
        """Decodes one payload.

        Args:
            payload: bytes produced by ``encode`` of a codec with the same name.
            num_elements: number of fp32 values the payload must decode to.
        Returns:
            A new 1-D float32 CPU tensor of ``num_elements`` values.
        Raises:
            CodecError: the payload does not decode to exactly ``num_elements`` values.
        """
        ...


def crc32(payload: bytes) -> int:
    """Returns the CRC-32 (zlib polynomial) of ``payload`` as an unsigned 32-bit int."""
    return zlib.crc32(payload) & 0xFFFFFFFF


def _check_chunk(chunk: torch.Tensor) -> np.ndarray:
    if chunk.dim() != 1 or chunk.dtype != torch.float32 or chunk.device.type != "cpu":
        raise ValueError(
            f"codec input must be a 1-D float32 CPU tensor, got {tuple(chunk.shape)} "
            f"{chunk.dtype} on {chunk.device}"
        )
    array = chunk.detach().contiguous().numpy()
    # Only a big-endian host pays for a byte swap; little-endian is a no-op view.
    return array if sys.byteorder == "little" else array.astype(_FP32)


class RawCodec:
    """Exact fp32 little-endian bytes: ``num_elements * 4`` bytes per chunk."""

    name = "raw"

    def encode(self, chunk: torch.Tensor) -> bytes:
        """See :meth:`Codec.encode`."""
        return _check_chunk(chunk).tobytes()

    def decode(self, payload: bytes, num_elements: int) -> torch.Tensor:
        """See :meth:`Codec.decode`."""
        expected = num_elements * _FP32.itemsize
        if num_elements < 0 or len(payload) != expected:
            raise CodecError(
                f"raw payload has {len(payload)} bytes, expected {expected} "
                f"for {num_elements} fp32 elements"
            )
        # frombuffer is a view of immutable bytes; copy once so the tensor is writable
        # (torch warns on read-only numpy arrays) and owns its memory.
        values = np.frombuffer(payload, dtype=_FP32).astype(np.float32, copy=True)
        return torch.from_numpy(values)


class ZstdCodec:
    """Plain zstd of the fp32 bytes (no shuffle stage yet).

    Args:
        level: zstd compression level; 1 is fast and already finds the zero runs.
        threads: zstd worker threads for compression (0 = compress on the caller).
    """

    def __init__(self, level: int = 1, threads: int = 0) -> None:
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        if threads < 0:
            raise ValueError(f"zstd threads must be >= 0, got {threads}")
        self.level = level
        self.threads = threads
        self.name = f"zstd:{level}"
        self._raw = RawCodec()
        # zstandard (de)compressor objects are not thread-safe but are costly to
        # build per call, so each thread keeps its own pair.
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        comp = getattr(self._local, "compressor", None)
        if comp is None:
            comp = zstandard.ZstdCompressor(
                level=self.level, threads=self.threads, write_content_size=True
            )
            self._local.compressor = comp
        return comp

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dec = getattr(self._local, "decompressor", None)
        if dec is None:
            dec = zstandard.ZstdDecompressor()
            self._local.decompressor = dec
        return dec

    def encode(self, chunk: torch.Tensor) -> bytes:
        """See :meth:`Codec.encode`."""
        return self._compressor().compress(self._raw.encode(chunk))

    def decode(self, payload: bytes, num_elements: int) -> torch.Tensor:
        """See :meth:`Codec.decode`."""
        expected = num_elements * _FP32.itemsize
        if num_elements <= 0:
            raise CodecError(f"zstd chunk must hold at least one element, got {num_elements}")
        try:
            declared = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload has no valid frame header: {exc}") from exc
        # python-zstandard allocates the declared content size and ignores
        # max_output_size when the header has one, so a hostile header is refused here.
        if declared not in (-1, expected):
            raise CodecError(
                f"zstd frame declares {declared} bytes, expected {expected} "
                f"for {num_elements} fp32 elements"
            )
        try:
            raw = self._decompressor().decompress(
                payload, max_output_size=expected, allow_extra_data=False
            )
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload is corrupt: {exc}") from exc
        return self._raw.decode(raw, num_elements)


def make_codec(spec: str) -> Codec:
    """Builds a codec from its spec.

    Args:
        spec: "raw", "zstd" (level 1) or "zstd:LEVEL".
    Returns:
        The codec; its ``name`` is the canonical spec ("zstd" becomes "zstd:1").
    Raises:
        ValueError: unknown spec; the message lists the allowed values.
    """
    text = spec.strip().lower()
    if text == "raw":
        return RawCodec()
    if text == "zstd":
        return ZstdCodec()
    if text.startswith("zstd:"):
        level_text = text.removeprefix("zstd:")
        try:
            level = int(level_text)
        except ValueError:
            level = None
        if level is not None and -7 <= level <= 22:
            return ZstdCodec(level=level)
    raise ValueError(f"unknown codec {spec!r}; allowed: {ALLOWED_SPECS}")
