"""A codec chain's spec, parsed and checked without building it (no torch, no zstd):
the job config and the CLI refuse a bad ``sync.codec`` before any process imports
torch; :func:`isthmus.inter.data.codecs.chain.make_codec` builds the chain from the same parse.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALLOWED_SPECS", "CODEC_FORMAT", "CodecSpec", "parse_codec_spec"]

ALLOWED_SPECS = (
    'TENSOR[+shuffle][+zstd[:LEVEL[:THREADS]]] with TENSOR one of "raw" (fp32), "bf16", '
    '"int8" or "int4" (a scale per 1024 values, error feedback), e.g. "raw", "bf16+shuffle+zstd:3", '
    '"int8+zstd:1"; LEVEL an integer from -7 to 22; "zstd[:LEVEL]" alone means raw+zstd'
)
CODEC_FORMAT = 2
"""Version of the codecs' payload layouts, in the job fingerprint (sync.codec_format):
a site whose int8 payloads are laid out otherwise would fail every chunk's size check,
so it is refused at join instead. 2: int8/int4 carry a scale per 1024 values (1: one
per chunk)."""

TENSOR_STAGES = {"raw": "raw", "fp32": "raw", "bf16": "bf16", "int8": "int8", "int4": "int4"}
"""Spelling -> the tensor stage's canonical name."""


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """One chain: a tensor stage, then optionally shuffle, then optionally zstd."""

    tensor: str  # ``raw``, ``bf16``, ``int8`` or ``int4``
    shuffle: bool = False
    zstd_level: int | None = None  # zstd's level, or None without zstd
    zstd_threads: int = 0
    """zstd worker threads; not part of :attr:`name` (speed, not the bytes' meaning)."""

    @property
    def name(self) -> str:
        """The canonical spec every site must agree on (``"zstd"`` is ``"raw+zstd:1"``)."""
        parts = [self.tensor, *(["shuffle"] if self.shuffle else [])]
        if self.zstd_level is not None:
            parts.append(f"zstd:{self.zstd_level}")
        return "+".join(parts)


def _zstd(text: str) -> tuple[int, int] | None:
    parts = text.split(":")
    if parts[0] != "zstd" or len(parts) > 3:
        return None
    try:
        level = int(parts[1]) if len(parts) > 1 else 1
        threads = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        return None
    if not -7 <= level <= 22 or not 0 <= threads <= 64:
        return None
    return level, threads


def parse_codec_spec(spec: str) -> CodecSpec:
    """Parses e.g. "raw", "bf16", "int8", "bf16+shuffle+zstd:3", "int8+zstd:1".

    Raises:
        ValueError: unknown spec; the message lists the allowed forms.
    """
    parts = [p.strip() for p in spec.strip().lower().split("+")]
    unknown = ValueError(f"unknown codec {spec!r}; allowed: {ALLOWED_SPECS}")
    tensor = TENSOR_STAGES.get(parts[0])
    if tensor is not None:
        parts.pop(0)
    shuffle = bool(parts) and parts[0] == "shuffle"
    if shuffle:
        parts.pop(0)
    zstd = _zstd(parts[0]) if parts else None
    if zstd is not None:
        parts.pop(0)
    if parts or (tensor is None and not shuffle and zstd is None):
        raise unknown
    level, threads = zstd if zstd is not None else (None, 0)
    return CodecSpec(tensor or "raw", shuffle, level, threads)
