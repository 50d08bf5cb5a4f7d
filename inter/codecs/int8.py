"""int8 with one scale per chunk and error feedback.

Encoding adds the chunk's residual (what earlier roundings lost) before quantizing
and keeps the new rounding error as the next residual, so over many steps the sum of
the decoded values tracks the sum of the true ones (Seide et al. 2014; Karimireddy
et al. 2019). Only the decoded values leave the encoder: every site uses them, so
replicas stay bitwise identical; the residual is this site's own state.
"""

from __future__ import annotations

import math
import struct
import threading

import numpy as np
import torch

from .base import check_chunk, check_size, from_le, to_device, to_host_view

__all__ = ["Int8Stage"]

_SCALE = struct.Struct("<f")  # payload = fp32 scale, then one int8 per element
_SMALLEST = float(np.finfo(np.float32).tiny)


def _nan_payload(num_elements: int) -> bytes:
    return _SCALE.pack(math.nan) + bytes(num_elements)


class Int8Stage:
    """Symmetric int8 (-127..127) with a per-chunk fp32 scale and error feedback.

    Args:
        error_feedback: keep per-key residuals (``encode`` with a ``key``).
    """

    name = "int8"
    width = 1
    lossy = True

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        self._residuals: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # pool threads encode different keys concurrently

    def encoded_size(self, num_elements: int) -> int:
        """See :meth:`TensorStage.encoded_size`."""
        return _SCALE.size + num_elements

    def encode(self, chunk: torch.Tensor, key: str | None = None) -> bytes:
        """Quantizes on the chunk's device; see :meth:`TensorStage.encode`.

        Args:
            chunk: 1-D fp32 tensor (CPU or CUDA).
            key: error-feedback state key (lane, group, chunk); None = no feedback.
        Returns:
            The fp32 scale followed by the int8 values.
        """
        use_ef = self.error_feedback and key is not None
        x = self._with_residual(check_chunk(chunk), key if use_ef else None)
        if x.is_cuda and x.numel():
            return self._encode_device(x, key if use_ef else None)
        amax = float(x.abs().max()) if x.numel() else 0.0
        if not math.isfinite(amax):
            self._forget(key if use_ef else None)
            return _nan_payload(x.numel())
        scale = np.float32(amax / 127.0 if amax > 0 else 1.0)
        q = torch.round(x / float(scale)).clamp_(-127, 127).to(torch.int8)
        if use_ef:
            # The residual is measured against exactly what decode will produce.
            decoded = q.to(torch.float32) * float(scale)
            with self._lock:
                self._residuals[key] = x - decoded
        return b"".join([_SCALE.pack(scale), to_host_view(q)])

    def _with_residual(self, x: torch.Tensor, key: str | None) -> torch.Tensor:
        """``x`` plus the residual kept under ``key`` (what earlier roundings lost)."""
        if key is None:
            return x
        with self._lock:
            residual = self._residuals.get(key)
        # A residual of another shape belongs to an older layout and is dropped; a
        # loaded one (CPU) moves to the chunk's device.
        if residual is not None and residual.shape == x.shape:
            x = x + residual.to(x.device)
        return x

    def _encode_device(self, x: torch.Tensor, key: str | None) -> memoryview:
        """The CUDA encode: scale, values and residual computed on the GPU, then one
        copy of the whole payload to the host, the only wait. (Reading the scale first,
        as the host path does, cost a second synchronization per chunk, each queued
        behind whatever backward had put on the GPU.)"""
        # Every line is a kernel launched under the GIL, which the lane's other threads
        # want too (a profile of a CUDA lane showed its pool waiting for the GIL most of
        # the time), so the encode uses as few as it can.
        amax = x.abs().amax()
        # A NaN or infinite amax stays in the scale (clamp keeps NaN), which the host
        # checks below; an all-zero chunk gets the smallest scale and encodes as zeros.
        # The scale travels with the values, so it need not be the host path's bits.
        scale = (amax / 127.0).clamp_(min=_SMALLEST)
        values = torch.div(x, scale).round_().clamp_(-127, 127)  # integers, as fp32
        payload = torch.empty(_SCALE.size + x.numel(), dtype=torch.uint8, device=x.device)
        payload[: _SCALE.size].copy_(scale.reshape(1).view(torch.uint8))
        payload[_SCALE.size :].view(torch.int8).copy_(values)
        if key is not None:
            residual = x - values.mul_(scale)  # what decode produces: fp32(q) x scale
            with self._lock:
                self._residuals[key] = residual
        host = to_host_view(payload)  # waits for the stream: the bytes are final
        (scale_value,) = _SCALE.unpack_from(host)
        if not math.isfinite(scale_value):
            self._forget(key)
            return memoryview(_nan_payload(x.numel()))
        return host

    def _forget(self, key: str | None) -> None:
        # A non-finite gradient decodes to NaN everywhere (as raw would propagate it)
        # and must not poison the residual for later steps.
        if key is not None:
            with self._lock:
                self._residuals.pop(key, None)

    def decode(self, payload: bytes | memoryview, num_elements: int) -> torch.Tensor:
        """See :meth:`TensorStage.decode`."""
        return torch.from_numpy(self.decode_array(payload, num_elements))

    def decode_array(self, payload: bytes | memoryview, num_elements: int) -> np.ndarray:
        """See :meth:`TensorStage.decode_array` (a new array)."""
        expected = self.encoded_size(num_elements)
        check_size("int8", payload, expected, num_elements)
        (scale,) = _SCALE.unpack_from(payload)
        q = from_le(payload[_SCALE.size :], np.int8)
        return q.astype(np.float32) * np.float32(scale)

    def decode_device(
        self, payload: bytes | memoryview, num_elements: int, device: torch.device
    ) -> torch.Tensor:
        """See :meth:`TensorStage.decode_device`: fp32(q) x scale, as on the host."""
        check_size("int8", payload, self.encoded_size(num_elements), num_elements)
        raw = to_device(payload, device)
        scale = raw[: _SCALE.size].view(torch.float32)  # the wire is little-endian
        return raw[_SCALE.size :].view(torch.int8).to(torch.float32) * scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Returns a copy of the residuals by key (CPU tensors, for a checkpoint)."""
        with self._lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replaces the residuals; they move to a chunk's device on first use."""
        with self._lock:
            self._residuals = {
                str(k): v.detach().to(torch.float32).reshape(-1).clone() for k, v in state.items()
            }
