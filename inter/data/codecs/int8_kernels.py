"""The int8 codec's GPU work as two Triton kernels: one quantize, one dequantize.

In torch operations a CUDA chunk costs about a dozen launches to encode and four to
decode, each holding the GIL the training loop's launches need (a CUDA int8 lane spent
41 % of its busy time in the encode, docs/benchmarks/lanes.md). Here the encode is one
kernel that reads the chunk and its residual once.

Bit for bit the same payload as the torch code on the CPU, so a CUDA site and a CPU
site (or the CPU tests) agree exactly: the scale is ``amax / 127`` as an IEEE division
(torch divides by a Python number on CUDA as a product with its reciprocal), the
values ``x / scale`` as IEEE division, rounded half to even by the classic 1.5 * 2**23
addition (exact for the magnitudes a scale allows), and no multiply-add is fused
(``enable_fp_fusion=False``: fp32(q) x scale and the residual's subtraction round
separately, as on the host).

Used where Triton imports and the chunk is on a GPU; ``ISTHMUS_FUSED=0`` turns it off
(the torch code runs instead). ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors,
which is how the tests check them on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

__all__ = ["dequantize", "quantize", "usable"]

_BLOCK = 1024  # int8.BLOCK: one scale per block, one kernel program per block
_lock = threading.Lock()
_interpret_lock = threading.Lock()
_kernels: tuple | None = None
_decided = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels run for ``t``: on a GPU with Triton (or on the CPU under
    Triton's interpreter), unless ``ISTHMUS_FUSED=0``."""
    if not (t.is_cuda or _interpreting()) or os.environ.get("ISTHMUS_FUSED", "1") == "0":
        return False
    return _load() is not None


def _load() -> tuple | None:
    global _kernels, _decided
    if _decided:
        return _kernels
    with _lock:
        if not _decided:
            try:
                _kernels = _build()
            except ImportError:
                _kernels = None
            _decided = True
    return _kernels


def _build() -> tuple:
    import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped,import-not-found,unused-ignore]

    @triton.jit
    def quantize_kernel(
        x_ptr,
        residual_ptr,
        new_residual_ptr,
        decoded_ptr,
        scales_ptr,
        q_ptr,
        n,
        levels,
        smallest,
        HAS_RESIDUAL: tl.constexpr,
        KEEP_RESIDUAL: tl.constexpr,
        KEEP_DECODED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        block = tl.program_id(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        v = tl.load(x_ptr + offsets, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            v = v + tl.load(residual_ptr + offsets, mask=inside, other=0.0)
        amax = tl.max(tl.abs(v), axis=0)
        # A NaN or Inf anywhere makes the scale non-finite (v - v is 0 for a finite v,
        # NaN otherwise; a max reduction need not propagate NaN as torch's amax does):
        # the caller then sends the chunk as NaN.
        poison = tl.sum(v - v, axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, levels), smallest) + poison
        t = tl.math.div_rn(v, scale)
        # 1.5 * 2**23 (a literal: a kernel reads no module globals): adding and taking
        # it away again rounds |t| < 2**22 to the nearest integer, half to even.
        t = (t + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(t, -levels), levels)
        tl.store(scales_ptr + block, scale)
        tl.store(q_ptr + offsets, q.to(tl.int8), mask=inside)
        if KEEP_RESIDUAL or KEEP_DECODED:
            decoded = q * scale
            if KEEP_RESIDUAL:
                tl.store(new_residual_ptr + offsets, v - decoded, mask=inside)
            if KEEP_DECODED:
                tl.store(decoded_ptr + offsets, decoded, mask=inside)

    @triton.jit
    def dequantize_kernel(scales_ptr, q_ptr, out_ptr, n, BLOCK: tl.constexpr):
        block = tl.program_id(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        scale = tl.load(scales_ptr + block)
        q = tl.load(q_ptr + offsets, mask=inside, other=0).to(tl.float32)
        tl.store(out_ptr + offsets, q * scale, mask=inside)

    return quantize_kernel, dequantize_kernel


def _launching() -> contextlib.AbstractContextManager:
    """Nothing on a GPU; under the interpreter, the one lock its launches take: it
    patches the language's globals while a kernel runs, so two threads' kernels (a
    round's pool) would break each other."""
    return _interpret_lock if _interpreting() else contextlib.nullcontext()


def _launch_options() -> dict:
    # The interpreter runs numpy (IEEE, nothing fused) and knows no compile options.
    return {} if _interpreting() else {"enable_fp_fusion": False}


def quantize(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    new_residual: torch.Tensor | None,
    decoded: torch.Tensor | None,
    payload: torch.Tensor,
    levels: int,
    smallest: float,
) -> None:
    """Writes the int8 payload of ``x`` (+ ``residual``) into ``payload`` (uint8,
    ``4 * blocks + n`` bytes, on ``x``'s device): the fp32 scales of its blocks, then a
    byte per value. Queued on the current stream. This rounding's loss goes to
    ``new_residual`` (may be ``residual``), fp32(q) x scale to ``decoded`` (may be ``x``);
    ``smallest`` is the least scale (a block of zeros divides by it)."""
    kernel = _load()[0]  # type: ignore[index]
    n = x.numel()
    blocks = -(-n // _BLOCK)
    head = 4 * blocks
    with _launching():
        kernel[(blocks,)](
            x,
            residual if residual is not None else x,
            new_residual if new_residual is not None else x,
            decoded if decoded is not None else x,
            payload[:head].view(torch.float32),
            payload[head:].view(torch.int8),
            n,
            float(levels),
            smallest,
            HAS_RESIDUAL=residual is not None,
            KEEP_RESIDUAL=new_residual is not None,
            KEEP_DECODED=decoded is not None,
            BLOCK=_BLOCK,
            **_launch_options(),
        )


def dequantize(payload: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """fp32(q) x scale of an int8 payload (uint8 on the device) into ``out``; returns it."""
    kernel = _load()[1]  # type: ignore[index]
    blocks = -(-n // _BLOCK)
    head = 4 * blocks
    with _launching():
        kernel[(blocks,)](
            payload[:head].view(torch.float32),
            payload[head:].view(torch.int8),
            out,
            n,
            BLOCK=_BLOCK,
            **_launch_options(),
        )
    return out
