"""int8 with one scale per block of 1024 values and error feedback.

Encoding adds the chunk's residual (what earlier roundings lost) before quantizing
and keeps the new rounding error as the next residual, so over many steps the sum of
the decoded values tracks the sum of the true ones (Seide et al. 2014; Karimireddy
et al. 2019). Only the decoded values leave the encoder: every site uses them, so
replicas stay bitwise identical; the residual is this site's own state.

Each block of ``BLOCK`` values has its own fp32 scale (its largest magnitude / 127),
as in blockwise quantization (Dettmers et al. 2022). One scale per chunk (up to ~262k
values) let the largest gradient of a quarter of the model set everyone's step: values
under 1/254 of it rounded to zero, and per-step sync with int8 trailed raw by 16 % in
held-out loss (docs/benchmarks/training-quality.md). The scales cost 0.4 %.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from isthmus.inter.data.codecs import int8_kernels
from isthmus.inter.data.codecs.base import check_chunk, check_size, from_le, to_device, to_host_view

__all__ = ["BLOCK", "Int8Stage", "block_scales", "blockwise_levels", "expand_scales", "scale_bytes"]

_FP32_MAX = float(np.finfo(np.float32).max)

BLOCK = 1024
"""Values per scale (part of the wire format: every site of a job runs one version)."""
_SCALE_BYTES = 4  # one little-endian fp32 per block, all before the values
_SMALLEST = float(np.finfo(np.float32).tiny)


def _blocks(num_elements: int) -> int:
    return -(-num_elements // BLOCK)


def scale_bytes(num_elements: int) -> int:
    return _SCALE_BYTES * _blocks(num_elements)


def blockwise_levels(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` to integers in [-levels, levels] with one scale per block:
    ``(scales, q)``, fp32 scales ``[blocks]`` and the integers as fp32 ``[blocks, BLOCK]``
    (the last block zero-padded). A non-finite block keeps a non-finite scale (clamp
    keeps NaN): the caller sends the chunk as NaN."""
    n = x.numel()
    blocks = _blocks(n)
    # Chunks are mostly whole blocks: pad (a copy) only the short last one.
    padded = x if n == blocks * BLOCK else F.pad(x, (0, blocks * BLOCK - n))
    padded = padded.view(blocks, BLOCK)
    scales = (padded.abs().amax(dim=1) / levels).clamp_(min=_SMALLEST)
    q = torch.div(padded, scales[:, None]).round_().clamp_(-levels, levels)
    return scales, q


def block_scales(payload: bytes | memoryview, num_elements: int) -> np.ndarray:
    return from_le(payload[: scale_bytes(num_elements)], np.float32)


def expand_scales(scales: np.ndarray | torch.Tensor, num_elements: int):
    """Each block's scale repeated over its values, cut to ``num_elements``."""
    if isinstance(scales, np.ndarray):
        return np.repeat(scales, BLOCK)[:num_elements]
    return scales.repeat_interleave(BLOCK)[:num_elements]


class Int8Stage:
    """Symmetric int8 (-127..127) with an fp32 scale per ``BLOCK`` values and error
    feedback (per-key residuals, for ``encode`` with a ``key``)."""

    name = "int8"
    width = 1
    lossy = True
    levels = 127
    """Largest magnitude of a quantized value (symmetric)."""
    wire_max = 128
    """Largest magnitude an integer on the wire can hold (a hostile int8 may be -128)."""
    fused = True
    """Whether a GPU chunk takes the fused kernels (:mod:`.int8_kernels`): this format's."""

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        self._residuals: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # pool threads encode different keys concurrently

    def encoded_size(self, num_elements: int) -> int:
        # The scales, then a byte a value.
        return scale_bytes(num_elements) + num_elements

    def encode(
        self,
        chunk: torch.Tensor,
        key: str | None = None,
        decoded_out: torch.Tensor | None = None,
        host: bool = True,
    ) -> bytes | memoryview:
        """The fp32 scales followed by the int8 values, quantized on the chunk's device
        (on a GPU one fused kernel where Triton is, else the same torch code as on the
        CPU), then one copy to the host. ``key``: error-feedback state (lane, group,
        chunk); None = no feedback. ``decoded_out`` receives what :meth:`decode` of the
        payload returns, with no decode. ``host=False`` skips the payload's copy to the
        host (and its wait) on the fused GPU path, for a part that never leaves its
        site; ``b""`` is returned there, and the caller checks ``decoded_out`` itself.
        """
        key = key if self.error_feedback else None
        x = check_chunk(chunk)
        n = x.numel()
        if n == 0:
            return b""
        if self.fused and int8_kernels.usable(x):
            return self._encode_fused(x, key, decoded_out, host)
        residual = self._residual(x, key)  # what earlier roundings lost
        x = x if residual is None else x + residual
        scales, q = blockwise_levels(x, self.levels)
        if key is not None:  # measured against what decode produces: fp32(q) x scale
            decoded = (q * scales[:, None]).view(-1)[:n]
            with self._lock:
                self._residuals[key] = x - decoded
        head = _SCALE_BYTES * scales.numel()
        payload = torch.empty(self.encoded_size(n), dtype=torch.uint8, device=x.device)
        payload[:head].copy_(scales.view(torch.uint8))
        self._pack(q.view(-1)[:n], payload[head:])
        if decoded_out is not None:
            # From the payload's integers, as decode reads them: q rounded to -0.0 is
            # 0 on the wire, and a replica must not differ from another even there.
            self._unpack_into(payload, scales, n, decoded_out)
        self._before_host_copy()
        return self._checked(to_host_view(payload), n, key)

    def _encode_fused(
        self, x: torch.Tensor, key: str | None, decoded_out: torch.Tensor | None, host: bool
    ) -> bytes | memoryview:
        """:meth:`encode` as one kernel: the residual is read and rewritten in place."""
        residual = self._residual(x, key)
        fresh = torch.empty_like(x) if key is not None and residual is None else None
        payload = torch.empty(self.encoded_size(x.numel()), dtype=torch.uint8, device=x.device)
        int8_kernels.quantize(
            x, residual, fresh if fresh is not None else residual, decoded_out, payload,
            self.levels, _SMALLEST,
        )  # fmt: skip
        if key is not None and fresh is not None:
            with self._lock:
                self._residuals[key] = fresh
        if not host and decoded_out is not None:
            return b""
        self._before_host_copy()
        return self._checked(to_host_view(payload), x.numel(), key)

    @staticmethod
    def _pack(q: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.int8).copy_(q)

    @staticmethod
    def _unpack_into(
        payload: torch.Tensor, scales: torch.Tensor, n: int, out: torch.Tensor
    ) -> None:
        q = payload[_SCALE_BYTES * scales.numel() :].view(torch.int8)
        torch.mul(q.to(torch.float32), expand_scales(scales, n), out=out)

    def _before_host_copy(self) -> None:
        """Called once the device work of an encode is queued, before the blocking copy
        of its payload to the host (a test pauses an encode here)."""

    def _checked(self, host: memoryview, n: int, key: str | None) -> bytes | memoryview:
        """``host``, or an all-NaN payload when a scale is not finite: a non-finite
        gradient decodes to NaN everywhere (as raw would propagate it) and must not
        poison the residual for later steps."""
        if np.isfinite(block_scales(host, n)).all():
            return host
        self._forget(key)
        blocks = _blocks(n)
        return np.full(blocks, np.nan, dtype="<f4").tobytes() + bytes(
            self.encoded_size(n) - _SCALE_BYTES * blocks
        )

    def finite(self, payload: bytes | memoryview, num_elements: int) -> bool:
        """The integers are finite by construction, so the block scales say it (a
        non-finite block keeps a non-finite scale), and the largest of them times the
        largest integer the wire holds must stay within fp32: a forged finite scale of
        1e38 would decode to Inf. Exact for a payload from anywhere, so a received chunk
        is checked here, not after its decode."""
        scales = block_scales(payload, num_elements)
        if not np.isfinite(scales).all():
            return False
        # fp32 x a power of two is exact in float64; fp32(q x s) <= FP32_MAX when q x s is.
        return scales.size == 0 or float(np.abs(scales).max()) * self.wire_max <= _FP32_MAX

    def _residual(self, x: torch.Tensor, key: str | None) -> torch.Tensor | None:
        """The residual kept under ``key``, moved to ``x``'s device, or None."""
        if key is None:
            return None
        with self._lock:
            residual = self._residuals.get(key)
        # A residual of another shape belongs to an older layout and is dropped; a
        # loaded one (CPU) moves to the chunk's device, and is kept there.
        if residual is None or residual.shape != x.shape:
            return None
        if residual.device != x.device:
            residual = residual.to(x.device)
            with self._lock:
                self._residuals[key] = residual
        if residual.is_cuda:
            # Another pool thread made it on its own stream, and the torch path drops
            # it (the next residual replaces it) right after queuing its read. Without
            # this, the allocator hands its memory back to the maker's stream at once,
            # and that thread's next chunk could overwrite it before this stream's read
            # has run: a finite gradient then left as NaN (issue 38).
            residual.record_stream(torch.cuda.current_stream(x.device))
        return residual

    def _forget(self, key: str | None) -> None:
        if key is not None:
            with self._lock:
                self._residuals.pop(key, None)

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        return torch.from_numpy(self.decode_array(payload, num_elements))

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        check_size("int8", payload, self.encoded_size(num_elements), num_elements)
        head = scale_bytes(num_elements)
        q = from_le(payload[head:], np.int8)
        return q.astype(np.float32) * expand_scales(
            block_scales(payload, num_elements), num_elements
        )

    def decode_device(
        self, payload: bytes | memoryview, num_elements: int, device: torch.device
    ) -> torch.Tensor:
        """As on the host, on ``device`` (one kernel where Triton is)."""
        check_size(self.name, payload, self.encoded_size(num_elements), num_elements)
        raw = to_device(payload, device)
        out = torch.empty(num_elements, dtype=torch.float32, device=raw.device)
        if self.fused and int8_kernels.usable(raw):
            return int8_kernels.dequantize(raw, num_elements, out)
        scales = raw[: scale_bytes(num_elements)].view(torch.float32)  # the wire is little-endian
        self._unpack_into(raw, scales, num_elements, out)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        with self._lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replaces the residuals; they move to a chunk's device on first use."""
        with self._lock:
            self._residuals = {
                str(k): v.detach().to(torch.float32).reshape(-1).clone() for k, v in state.items()
            }
