"""A lane's per-byte work in C (``wirecore.c``, the extension ``_wirecore``); Python otherwise.

:func:`recv_payload` reads a chunk's payload from a plain TCP bulk connection straight
into the buffer the round uses, and checksums it (and checks an fp32 payload for
NaN/Inf) piece by piece while each piece is still in the cache: one pass over memory
instead of three, in one call that holds no GIL, so the training loop's thread is not
made to wait for it. The owner's sum of a raw chunk and a sender's checksum are one
pass each as well (:func:`sum_checked`, :func:`crc_of_finite`).

The extension is an optional part of the build (setup.py): where it is missing, or
``ISTHMUS_NATIVE=0``, the same results come from Python (``recv_into``, numpy and the
``crc32c`` package), which the first call says once in the log.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import socket
import sys
from types import ModuleType

import crc32c as _crc32c
import numpy as np

__all__ = [
    "FrameClosed",
    "all_finite",
    "crc_of_finite",
    "load",
    "read_exact",
    "one_pass_sums",
    "recv_payload",
    "sum_checked",
]

log = logging.getLogger(__name__)


class FrameClosed(ConnectionError):
    """The peer closed the connection in the middle of a payload."""


def _import() -> tuple[ModuleType | None, str]:
    if os.environ.get("ISTHMUS_NATIVE", "1") == "0":
        return None, "ISTHMUS_NATIVE=0"
    try:
        return importlib.import_module(f"{__package__}._wirecore"), ""
    except ImportError as exc:  # not built (no C compiler at install), or not loadable
        return None, str(exc)


_native, _why_not = _import()
_told = False


def load() -> ModuleType | None:
    """The C extension, or None where it was not built or is turned off (logged once)."""
    global _told
    if _native is None and not _told:
        _told = True
        why = _why_not
        log.warning(
            "wirecore: no C extension (%s): the lanes check their bytes in Python "
            "(same results, slower)",
            why,
        )
    return _native


def recv_payload(
    sock: socket.socket, buf: memoryview, stall_s: float, f32: bool
) -> tuple[int, bool | None]:
    """Fills ``buf`` from ``sock``; returns (CRC-32C of the bytes, whether every fp32
    word is finite, or None when not asked or not known). Raises FrameClosed (the peer
    closed before ``buf`` was full), TimeoutError (no byte for ``stall_s`` seconds) or
    OSError."""
    native = load()
    if not len(buf):
        return 0, True if f32 else None
    if native is None:
        sock.settimeout(stall_s)
        read_exact(sock, buf)
        return _crc32c.crc32c(buf), None
    stall_ms = max(1, int(stall_s * 1000))
    got, crc, nonfinite = native.recv_frame(sock.fileno(), buf, stall_ms, f32)
    if got == 0:
        raise FrameClosed("connection closed by the peer")
    if got < 0:
        if -got == errno.ETIMEDOUT:
            raise TimeoutError(f"no byte of the frame for {stall_s:.0f}s")
        raise OSError(-got, os.strerror(-got))
    return crc, (not nonfinite) if f32 else None


def _plain_f32(values: np.ndarray) -> bool:
    return values.dtype == np.float32 and values.flags.c_contiguous


def all_finite(values: np.ndarray) -> bool:
    """No NaN or Inf in a contiguous fp32 array: one read pass without a temporary
    (numpy's ``isfinite(...).all()`` writes and reads a mask as large again)."""
    native = load()
    if native is None or not _plain_f32(values):
        return bool(np.isfinite(values).all())
    return native.all_finite(values)


SUM_OK, SUM_OWN_NONFINITE, SUM_OVERFLOW = 0, 1, 2
"""What :func:`sum_checked` found: the sum and its CRC, a NaN or Inf in the owner's
own part (nothing summed past it), or a result that is not finite although its parts
are (an overflow)."""


def one_pass_sums() -> bool:
    """Whether :func:`sum_checked` sums here (the C extension is loaded, on a
    little-endian host: a raw payload is then the fp32 values' own bytes)."""
    return sys.byteorder == "little" and load() is not None


def crc_of_finite(values: np.ndarray) -> int | None:
    """The CRC-32C of a contiguous fp32 array's bytes, or None if it holds NaN or Inf:
    one pass in C where two were (the raw encode's check and the frame's checksum).
    Falls back to those two passes where the C extension is not loaded."""
    native = load()
    if native is None or not _plain_f32(values):
        return _crc32c.crc32c(values.tobytes()) if all_finite(values) else None
    return native.crc32c_f32(values)


def sum_checked(
    parts: list[np.ndarray], out: np.ndarray, own: int, divisor: float
) -> tuple[int, int] | None:
    """The owner's reduction of one chunk in one pass over memory, in C: ``out`` =
    ``((parts[0] + parts[1]) + parts[2] ...) / divisor`` in that order (fp32, the bits
    numpy's adds give), with ``parts[own]`` checked for NaN/Inf before it is added, and
    the result checked and checksummed as it is written. ``divisor`` 0 divides by
    nothing; ``own`` -1 checks no part. ``out`` may share memory with ``parts[0]`` or
    ``parts[1]`` (exactly), not with a later part.

    Returns ``(SUM_OK, the CRC-32C of out's bytes)``, or ``SUM_OWN_NONFINITE`` /
    ``SUM_OVERFLOW`` with crc 0 (``out`` then holds a partial sum); None where the C
    extension is not loaded or the arrays are not contiguous fp32 of one length: the
    caller sums, checks and checksums on its own.
    """
    native = load()
    if native is None or len(parts) < 2 or sys.byteorder != "little":
        return None
    for a in (out, *parts):
        if not _plain_f32(a) or a.size != out.size or a.ctypes.data % 4:
            return None
    if not out.flags.writeable:
        return None
    status, crc = native.sum_f32(out, parts, own, divisor)
    return status, (crc if status == SUM_OK else 0)


def read_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fills ``buf`` from ``sock`` with ``recv_into`` (the GIL released while it
    copies); raises FrameClosed if the peer closes first."""
    got, size = 0, len(buf)
    while got < size:
        n = sock.recv_into(buf[got:], size - got)
        if n == 0:
            raise FrameClosed("connection closed by the peer")
        got += n
