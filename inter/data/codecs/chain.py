"""Codec chains: a 1-D fp32 chunk into bytes for the wire, and back (docs/wire.md).

Encoding runs on the chunk's device (only the smaller result is copied to the host);
decoding yields CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

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
from isthmus.inter.data.codecs.spec import ALLOWED_SPECS, parse_codec_spec
from isthmus.inter.data.codecs.zstd import ZstdStage

__all__ = ["ALLOWED_SPECS", "CodecChain", "CodecError", "NonFiniteEncoding", "crc32", "make_codec"]

_TENSOR_STAGES: dict[str, Callable[[], TensorStage]] = {
    "raw": Fp32Stage,
    "bf16": Bf16Stage,
    "int8": Int8Stage,
    "int4": Int4Stage,
}


class CodecChain:
    """A tensor stage followed by byte stages (applied in order on encode, in reverse
    on decode)."""

    def __init__(self, tensor: TensorStage, byte_stages: list[ByteStage] | None = None) -> None:
        self.tensor = tensor
        self.byte_stages = list(byte_stages or [])
        self.name = "+".join([tensor.name, *(s.name for s in self.byte_stages)])

    @property
    def lossy(self) -> bool:
        """Whether decode(encode(x)) may differ from x."""
        return self.tensor.lossy

    @property
    def plain_fp32(self) -> bool:
        """Whether a payload is the values' own fp32 bytes (the raw stage alone), so that
        a lane may check, sum and checksum it in one pass (wirecore's ``sum_checked``)."""
        return isinstance(self.tensor, Fp32Stage) and not self.byte_stages

    def encode(
        self,
        chunk: torch.Tensor,
        key: str | None = None,
        *,
        require_finite: bool = False,
        decoded_out: torch.Tensor | None = None,
    ) -> bytes | memoryview:
        """Encodes one 1-D fp32 chunk, CPU or CUDA; ``key`` names its error-feedback
        state. ``require_finite``: raise NonFiniteEncoding rather than return a payload
        that decodes to NaN or Inf (checked on the tensor stage's bytes). ``decoded_out``
        (``chunk``'s size and device, may be ``chunk`` itself) receives what a decode of
        the payload gives, bit for bit, without a copy to the device and back.

        The payload is bytes, or (``raw`` and ``bf16`` without byte stages) a read-only
        view of the chunk's memory (valid until the chunk changes) or of pinned memory
        the view alone holds (a CUDA chunk's).
        """
        data = self._encode_values(chunk, key, require_finite, decoded_out)
        for stage in self.byte_stages:
            data = stage.encode(data)
        return data

    def keep_own(self, chunk: torch.Tensor, key: str, decoded_out: torch.Tensor) -> None:
        """A site's own part of a chunk it sums: ``decoded_out`` := decode(encode(chunk))
        and the residual moved on, as :meth:`encode` does, but for a part that is never
        sent: no byte stage runs (they are lossless), and on int8's fused GPU path no
        payload reaches the host either (no copy, no wait) and nothing is checked there:
        the caller checks what it sums ``decoded_out`` into (NonFiniteEncoding if a
        payload made on the host holds NaN or Inf)."""
        self._encode_values(chunk, key, True, decoded_out, host=False)

    def _encode_values(
        self,
        chunk: torch.Tensor,
        key: str | None,
        require_finite: bool,
        decoded_out: torch.Tensor | None,
        host: bool = True,
    ) -> bytes | memoryview:
        """The tensor stage's payload (and ``decoded_out``); ``host=False`` lets int8's
        fused kernel keep it on the device, returning ``b""``."""
        if decoded_out is not None and isinstance(self.tensor, Int8Stage):
            data = self.tensor.encode(chunk, key, decoded_out=decoded_out, host=host)
            if not host and len(data) == 0:
                return data  # kept on the device: nothing on the host to check
        else:
            data = self.tensor.encode(chunk, key)
        if require_finite:
            self._require_finite(data, chunk.numel())
        if decoded_out is not None and not isinstance(self.tensor, Int8Stage):
            self._decode_into(data, decoded_out)
        return data

    def _require_finite(self, data: bytes | memoryview, n: int) -> None:
        if not self.tensor.finite(data, n):
            raise NonFiniteEncoding(
                f"the {self.tensor.name} stage encoded {n} values to a payload holding NaN or Inf"
            )

    def _decode_into(self, data: bytes | memoryview, out: torch.Tensor) -> None:
        """``out`` := the tensor stage's decode of ``data`` (no copy where ``data`` is a
        lossless view of ``out`` itself)."""
        n = out.numel()
        if out.is_cuda:
            values = self.tensor.decode_device(data, n, out.device)
            if values.data_ptr() != out.data_ptr():
                out.copy_(values)
            return
        array = self.tensor.decode_array(data, n)
        target = out.numpy()
        if not np.may_share_memory(array, target):
            np.copyto(target, array)

    def payload_finite(self, payload: bytes | memoryview, num_elements: int) -> bool | None:
        """Whether ``payload`` decodes to finite values only, read off its scales (int8,
        int4: a 1024th of the values), or None where that would not be cheaper than a
        pass over the decoded values (raw and bf16 read every value either way; byte
        stages would have to be undone first) or the size is wrong (the decode says so)."""
        if self.byte_stages or not isinstance(self.tensor, Int8Stage):
            return None
        if len(payload) != self.tensor.encoded_size(num_elements):
            return None
        return self.tensor.finite(payload, num_elements)

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        """A new writable 1-D float32 CPU tensor of ``num_elements`` values; raises
        CodecError where ``payload`` does not decode to exactly that many."""
        return self.tensor.decode(self._unwrap(payload, num_elements), num_elements)

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        """Like :meth:`decode`, as native fp32 values that may be a read-only view of
        ``payload`` (``raw``: no copy at all); raises CodecError."""
        return self.tensor.decode_array(self._unwrap(payload, num_elements), num_elements)

    def decode_device(
        self, payload: bytes | memoryview, num_elements: int, device: torch.device
    ) -> torch.Tensor:
        """Like :meth:`decode`, on ``device`` (byte stages run on the host first, then
        only the tensor stage's bytes cross); raises CodecError."""
        return self.tensor.decode_device(self._unwrap(payload, num_elements), num_elements, device)

    def _unwrap(self, payload: bytes | memoryview, num_elements: int) -> bytes | memoryview:
        if num_elements <= 0:
            raise CodecError(f"a chunk must hold at least one element, got {num_elements}")
        size = self.tensor.encoded_size(num_elements)
        for stage in reversed(self.byte_stages):
            # Every byte stage after the tensor stage restores exactly its input size.
            payload = stage.decode(payload, size)
        return payload

    def state_dict(self) -> dict[str, torch.Tensor]:
        get = getattr(self.tensor, "state_dict", None)
        return get() if get is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores what :meth:`state_dict` returned (ignored by stateless stages)."""
        load = getattr(self.tensor, "load_state_dict", None)
        if load is not None:
            load(state)
        elif state:
            raise ValueError(f"codec {self.name!r} keeps no state, got {len(state)} entries")


def make_codec(spec: str) -> CodecChain:
    """The chain of ``spec`` (:func:`parse_codec_spec`); its ``name`` is the canonical
    spec every site must agree on."""
    parsed = parse_codec_spec(spec)
    tensor: TensorStage = _TENSOR_STAGES[parsed.tensor]()
    stages: list[ByteStage] = []
    if parsed.shuffle:
        stages.append(ShuffleStage(tensor.width))
    if parsed.zstd_level is not None:
        stages.append(ZstdStage(level=parsed.zstd_level, threads=parsed.zstd_threads))
    return CodecChain(tensor, stages)
