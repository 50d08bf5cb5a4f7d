"""The lane's receive path in C (``wirecore.c``), built on first use; Python otherwise.

:func:`recv_payload` reads a chunk's payload from a bulk connection straight into the
buffer the round uses, and checksums it (and checks an fp32 payload for NaN/Inf) piece
by piece while each piece is still in the cache: one pass over memory instead of
three, in one call that holds no GIL (ctypes releases it), so the training loop's
thread is not made to wait for it.

The library is compiled once per source version with the system's C compiler (``cc``,
or ``$CC``) into ``$ISTHMUS_HOME/native`` (default ``~/.isthmus/native``, a folder of
the user's own, mode 0700: a library someone else could write is never loaded). Where
no compiler works, or ``ISTHMUS_NATIVE=0``, the same results come from Python
(``recv_into`` and the ``crc32c`` package), and :data:`BACKEND` says which is in use.
``python3 -m isthmus.inter.data.transport.wirecore`` builds it ahead of time and prints where.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import crc32c as _crc32c
import numpy as np

__all__ = [
    "BACKEND",
    "FrameClosed",
    "all_finite",
    "crc_of_finite",
    "library_path",
    "load",
    "read_exact",
    "one_pass_sums",
    "recv_payload",
    "sum_checked",
]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("wirecore.c")
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE"]
_LIBS = ["-ldl"]  # dlopen, for the OpenSSL that Python's ssl loaded (glibc < 2.34)


class FrameClosed(ConnectionError):
    """The peer closed the connection in the middle of a payload."""


def _home() -> Path:
    return Path(os.environ.get("ISTHMUS_HOME") or Path.home() / ".isthmus")


def library_path() -> Path:
    """Where this source version's library is (or would be) built."""
    flags = " ".join(_FLAGS + _LIBS).encode()
    digest = hashlib.sha256(_SOURCE.read_bytes() + flags).hexdigest()[:16]
    return _home() / "native" / f"wirecore-{digest}-{sys.platform}.so"


def _private_dir(path: Path) -> None:
    """Makes ``path`` (and its parent) 0700 folders of this user, or raises OSError."""
    for folder in (path.parent, path):
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(f"{folder} is not a private folder of this user")


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc or $CC) on PATH")
    _private_dir(target.parent)
    # Built under a private name and renamed into place: ranks that start together
    # each build, and none ever loads a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *_FLAGS, "-o", tmp, str(_SOURCE), *_LIBS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-400:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _trusted(path: Path) -> bool:
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
BACKEND = "python"
"""``"native"`` once the C library is loaded, else ``"python"``."""


def load() -> ctypes.CDLL | None:
    """The C library (built on first use), or None where it cannot be (logged once)."""
    global _lib, _tried, BACKEND
    if _tried:  # every chunk asks: no lock once the answer is known
        return _lib
    with _lock:
        if not _tried:
            _lib = _open()
            BACKEND = "native" if _lib is not None else "python"
            _tried = True  # last: a reader that sees it sees _lib
        return _lib


def _open() -> ctypes.CDLL | None:
    if os.environ.get("ISTHMUS_NATIVE", "1") == "0":
        return None
    target = library_path()
    try:
        if not target.exists():
            _build(target)
        if not _trusted(target) or not _trusted(target.parent):
            raise PermissionError(f"{target} is writable by other users; not loaded")
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("wirecore: the C receive path is off (%s); using Python's", exc)
        return None
    lib.wc_crc32c.restype = ctypes.c_uint32
    lib.wc_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    lib.wc_recv_frame.restype = ctypes.c_long
    lib.wc_recv_frame.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.wc_all_finite.restype = ctypes.c_int
    lib.wc_all_finite.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.wc_crc32c_f32.restype = ctypes.c_int
    lib.wc_crc32c_f32.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32)]
    lib.wc_sum_f32.restype = ctypes.c_int
    lib.wc_sum_f32.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_uint32),
    ]
    lib.wc_ssl_bind.restype = ctypes.c_int
    lib.wc_ssl_bind.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.wc_ssl_fd.restype = ctypes.c_int
    lib.wc_ssl_fd.argtypes = [ctypes.c_void_p]
    lib.wc_ssl_recv_frame.restype = ctypes.c_long
    lib.wc_ssl_recv_frame.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.POINTER(ctypes.c_int),
    ]
    return lib


def _address(buf: memoryview) -> int:
    """The address of a writable, C-contiguous buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def recv_payload(
    sock: socket.socket, buf: memoryview, stall_s: float, f32: bool
) -> tuple[int, bool | None]:
    """Fills ``buf`` from ``sock``; returns (CRC-32C of the bytes, whether every fp32
    word is finite, or None when not asked or not known).

    Raises:
        FrameClosed: the peer closed before ``buf`` was full.
        TimeoutError: no byte came for ``stall_s`` seconds.
        OSError: the connection failed.
    """
    lib = load()
    if not len(buf):
        return 0, True if f32 else None
    if lib is None:
        return _recv_python(sock, buf, stall_s), None
    return _receive(lib.wc_recv_frame, (sock.fileno(),), buf, stall_s, f32)


def _receive(
    receive: Callable[..., int], head: tuple, buf: memoryview, stall_s: float, f32: bool
) -> tuple[int, bool | None]:
    """Calls a C receive (``head`` its first arguments, then wc_recv_frame's contract)
    and turns its result into (CRC, finite) or the exception it stands for."""
    crc, nonfinite = ctypes.c_uint32(), ctypes.c_int()
    got = receive(
        *head,
        _address(buf),
        len(buf),
        max(1, int(stall_s * 1000)),
        int(f32),
        ctypes.byref(crc),
        ctypes.byref(nonfinite),
    )
    if got == 0:
        raise FrameClosed("connection closed by the peer")
    if got < 0:
        if -got == errno.ETIMEDOUT:
            raise TimeoutError(f"no byte of the frame for {stall_s:.0f}s")
        raise OSError(-got, os.strerror(-got))
    return crc.value, (not nonfinite.value) if f32 else None


_ssl_state: bool | None = None  # whether wc_ssl_bind found this process's OpenSSL


def _ssl_bound(lib: ctypes.CDLL) -> bool:
    """Binds the C TLS receive to the OpenSSL that Python's ssl module loaded (its
    libssl and libcrypto, as /proc/self/maps lists them); False where it cannot."""
    global _ssl_state
    if _ssl_state is None:
        with _lock:
            if _ssl_state is None:
                _ssl_state = _bind_ssl(lib)
    return _ssl_state


def _bind_ssl(lib: ctypes.CDLL) -> bool:
    import ssl  # noqa: F401 (loads the libraries looked for)
    import sysconfig

    # CPython's PySSLSocket begins with PyObject_HEAD, the weakref to its socket, then
    # the SSL pointer (Modules/_ssl.c, 3.10-3.13); a free-threaded build's head differs.
    if not (3, 10) <= sys.version_info[:2] <= (3, 13) or sysconfig.get_config_var(
        "Py_GIL_DISABLED"
    ):
        return False
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return False
    libssl = sorted(p for p in paths if os.path.basename(p).startswith("libssl.so"))
    libcrypto = sorted(p for p in paths if os.path.basename(p).startswith("libcrypto.so"))
    if len(libssl) != 1 or len(libcrypto) != 1:  # none (a static build), or two: unsure
        return False
    return lib.wc_ssl_bind(libssl[0].encode(), libcrypto[0].encode()) == 0


def _ssl_pointer(lib: ctypes.CDLL, sock: ssl.SSLSocket) -> int | None:
    """The SSL pointer of ``sock``'s TLS object, checked: it must read ``sock``'s own
    descriptor (``SSL_get_fd``), else None and the Python path is used."""
    obj = getattr(sock, "_sslobj", None)
    if obj is None or not _ssl_bound(lib):
        return None
    word = ctypes.sizeof(ctypes.c_void_p)
    pointer = ctypes.c_void_p.from_address(id(obj) + 3 * word).value
    if not pointer or lib.wc_ssl_fd(pointer) != sock.fileno():
        return None
    return pointer


def ssl_recv_payload(
    sock: ssl.SSLSocket, buf: memoryview, stall_s: float, f32: bool
) -> tuple[int, bool | None] | None:
    """:func:`recv_payload` through ``sock``'s TLS, in C without the GIL; None where
    the C path is not available (then the caller reads in Python). The caller is the
    only thread using ``sock`` for the call's length (``TlsStream``'s lock).

    Raises:
        FrameClosed, TimeoutError, OSError: as :func:`recv_payload`.
    """
    lib = load()
    if lib is None:
        return None
    pointer = _ssl_pointer(lib, sock)
    if pointer is None:
        return None
    if not len(buf):
        return 0, True if f32 else None
    return _receive(lib.wc_ssl_recv_frame, (pointer, sock.fileno()), buf, stall_s, f32)


def all_finite(values: np.ndarray) -> bool:
    """No NaN or Inf in a contiguous fp32 array: one read pass without a temporary
    (numpy's ``isfinite(...).all()`` writes and reads a mask as large again)."""
    lib = load()
    if lib is None or values.dtype != np.float32 or not values.flags.c_contiguous:
        return bool(np.isfinite(values).all())
    return bool(lib.wc_all_finite(values.ctypes.data, values.size))


SUM_OK, SUM_OWN_NONFINITE, SUM_OVERFLOW = 0, 1, 2
"""What :func:`sum_checked` found: the sum and its CRC, a NaN or Inf in the owner's
own part (nothing summed past it), or a result that is not finite although its parts
are (an overflow)."""


def one_pass_sums() -> bool:
    """Whether :func:`sum_checked` sums here (the C library is loaded, on a
    little-endian host: a raw payload is then the fp32 values' own bytes)."""
    return sys.byteorder == "little" and load() is not None


def crc_of_finite(values: np.ndarray) -> int | None:
    """The CRC-32C of a contiguous fp32 array's bytes, or None if it holds NaN or Inf:
    one pass in C where two were (the raw encode's check and the frame's checksum).
    Falls back to those two passes where the C library is not loaded."""
    lib = load()
    if lib is None or values.dtype != np.float32 or not values.flags.c_contiguous:
        return _crc32c.crc32c(values.tobytes()) if all_finite(values) else None
    crc = ctypes.c_uint32(0)
    if lib.wc_crc32c_f32(values.ctypes.data, values.size, ctypes.byref(crc)):
        return None
    return crc.value


def sum_checked(
    parts: list[np.ndarray], out: np.ndarray, own: int, divisor: float
) -> tuple[int, int] | None:
    """The owner's reduction of one chunk in one pass over memory, in C: ``out`` =
    ``((parts[0] + parts[1]) + parts[2] ...) / divisor`` in that order (fp32, the bits
    numpy's adds give), with ``parts[own]`` checked for NaN/Inf before it is added, and
    the result checked and checksummed as it is written. ``divisor`` 0 divides by
    nothing; ``own`` -1 checks no part. ``out`` may share memory with ``parts[0]`` or
    ``parts[1]`` (exactly), not with a later part.

    Returns:
        ``(status, crc)``: ``SUM_OK`` with the CRC-32C of ``out``'s bytes, or
        ``SUM_OWN_NONFINITE`` / ``SUM_OVERFLOW`` (``out`` then holds a partial sum,
        crc 0). None where the C library is not loaded or the arrays are not contiguous
        fp32 of one length: the caller sums, checks and checksums on its own.
    """
    lib = load()
    if lib is None or len(parts) < 2 or sys.byteorder != "little":
        return None
    n = out.size
    for a in (out, *parts):
        aligned = a.ctypes.data % 4 == 0
        if a.dtype != np.float32 or a.size != n or not a.flags.c_contiguous or not aligned:
            return None
    if not out.flags.writeable:
        return None
    pointers = (ctypes.c_void_p * len(parts))(*(a.ctypes.data for a in parts))
    crc = ctypes.c_uint32(0)
    status = lib.wc_sum_f32(
        out.ctypes.data, pointers, len(parts), own, divisor, n, ctypes.byref(crc)
    )
    return status, (crc.value if status == SUM_OK else 0)


def read_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fills ``buf`` from ``sock`` with ``recv_into`` (the GIL released while it
    copies); raises FrameClosed if the peer closes first."""
    got, size = 0, len(buf)
    while got < size:
        n = sock.recv_into(buf[got:], size - got)
        if n == 0:
            raise FrameClosed("connection closed by the peer")
        got += n


def _recv_python(sock: socket.socket, buf: memoryview, stall_s: float) -> int:
    sock.settimeout(stall_s)
    read_exact(sock, buf)
    return _crc32c.crc32c(buf)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    load()
    print(f"wirecore: {BACKEND}" + (f" ({library_path()})" if BACKEND == "native" else ""))
    sys.exit(0 if BACKEND == "native" else 1)
