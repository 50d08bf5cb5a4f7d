"""A small tmpfs for tests of a full disk: real ENOSPC from the kernel, no mocks."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``mount``'s syntax: ``4m``) at ``path``, unmounted on exit.

    Skips the test where mounting is not permitted (it needs root, or CAP_SYS_ADMIN in a
    container): a full disk cannot be made for real otherwise.
    """
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(
            f"cannot mount a {size} tmpfs to fill a disk for real (needs root or "
            f"CAP_SYS_ADMIN): {mount.stderr.strip()}"
        )
    try:
        yield path
    finally:
        # Lazy: a process of a failed test that still holds a file there must not
        # leave the mount behind.
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` to the last byte; returns the filler file."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: full
        while True:
            f.write(b"\0" * 4096)
    return filler
