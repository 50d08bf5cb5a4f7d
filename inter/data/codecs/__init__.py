"""Codec stages, one per module; :mod:`isthmus.inter.data.codec` chains them.

A *tensor stage* turns a 1-D float32 tensor (CPU or CUDA) into little-endian bytes
on the host and back (:mod:`.fp32`, :mod:`.bf16`, :mod:`.int8`, :mod:`.int4`); *byte stages*
transform those bytes (:mod:`.shuffle`, :mod:`.zstd`).
"""

from isthmus.inter.data.codecs.base import (
    ByteStage,
    CodecError,
    NonFiniteEncoding,
    TensorStage,
    crc32,
)
from isthmus.inter.data.codecs.bf16 import Bf16Stage
from isthmus.inter.data.codecs.fp32 import Fp32Stage
from isthmus.inter.data.codecs.int4 import Int4Stage
from isthmus.inter.data.codecs.int8 import Int8Stage
from isthmus.inter.data.codecs.shuffle import ShuffleStage
from isthmus.inter.data.codecs.zstd import ZstdStage

__all__ = [
    "Bf16Stage",
    "ByteStage",
    "CodecError",
    "Fp32Stage",
    "Int4Stage",
    "Int8Stage",
    "NonFiniteEncoding",
    "ShuffleStage",
    "TensorStage",
    "ZstdStage",
    "crc32",
]
