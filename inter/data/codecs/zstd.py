"""zstd compression of the bytes the earlier stages produced."""

from __future__ import annotations

import threading

import zstandard

from isthmus.inter.data.codecs.base import CodecError

__all__ = ["ZstdStage"]


class ZstdStage:
    """zstd at ``level``; compression and decompression release the GIL.

    Args:
        level: zstd level, -7..22; 1 is fast and already finds zero runs.
        threads: zstd worker threads per compression (0 = on the caller). Not part of
            the name: it changes speed, not the bytes' meaning, so sites may differ.
    """

    def __init__(self, level: int = 1, threads: int = 0) -> None:
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        if threads < 0:
            raise ValueError(f"zstd threads must be >= 0, got {threads}")
        self.level = level
        self.threads = threads
        self.name = f"zstd:{level}"
        # (De)compressor objects are not thread-safe but costly to build per call, so
        # each thread of the encode/decode pool keeps its own pair.
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
            dec = self._local.decompressor = zstandard.ZstdDecompressor()
        return dec

    def encode(self, data: bytes | memoryview) -> bytes:
        return self._compressor().compress(data)

    def decode(self, data: bytes | memoryview, size: int) -> bytes:
        """See :meth:`ByteStage.decode`; refuses frames that declare another size."""
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload has no valid frame header: {exc}") from exc
        # python-zstandard allocates the declared content size and ignores
        # max_output_size when the header has one, so a hostile header is refused here.
        if declared not in (-1, size):
            raise CodecError(f"zstd frame declares {declared} bytes, expected {size}")
        try:
            out = self._decompressor().decompress(
                data, max_output_size=max(size, 1), allow_extra_data=False
            )
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd payload is corrupt: {exc}") from exc
        if len(out) != size:
            raise CodecError(f"zstd payload decodes to {len(out)} bytes, expected {size}")
        return out
