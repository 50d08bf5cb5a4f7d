"""Why a checkpoint save failed, as one line that names the errno and the file
(issue 33, row 12: a full disk stopped the job with an empty reason).

A failed ``write()`` carries no file name, torch.save's zip writer turns the stream's
OSError into RuntimeError "unexpected pos", and DCP gathers every rank's failure to
rank 0 by pickling it, which drops what the exception was raised while handling. So the
streams DCP writes through re-raise the OSError with its file's name
(``FileNamingFileSystem``), and what is left unnamed is read off DCP's frames and files.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem

from .checkpoint_errors import describe_os_error

__all__ = ["FileNamingFileSystem", "dcp_failure", "describe_os_error"]


class FileNamingFileSystem(FileSystem):
    """DCP's file system, but a failed write raises the OSError that failed it, with the
    file's name (the module docstring says why)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        except RuntimeError as exc:
            cause = _os_error_under(exc)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, str(path)) from exc


def _os_error_under(exc: BaseException) -> OSError | None:
    """The OSError an exception was raised while handling (its ``__context__`` chain)."""
    seen = exc.__cause__ or exc.__context__
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def dcp_failure(exc: CheckpointException, partial: Path) -> str:
    """What failed in a DCP save, as one line naming the file where it can."""
    failures = sorted(exc.failures.items())
    # An OSError first; else the first failure, which on a full disk may not be one:
    # torch.save's zip writer reports a short write as "unexpected pos" (RuntimeError).
    rank, (error, frames) = next(
        ((r, f) for r, f in failures if isinstance(f[0], OSError)), failures[0]
    )
    if isinstance(error, OSError) and error.filename is not None:
        return describe_os_error(error)  # FileNamingFileSystem named the file
    if any(frame.name == "finish" for frame in frames):  # rank 0 writing .metadata
        where = partial / ".metadata"
    else:
        # A write() error names no file: DCP writes rank R's data to __R_<i>.distcp, one
        # after another, so the last one there is the one it was writing.
        files = sorted(
            partial.glob(f"__{rank}_*{DEFAULT_SUFFIX}"), key=lambda f: int(f.stem.split("_")[-1])
        )
        where = files[-1] if files else partial
    if not isinstance(error, OSError):
        full = _out_of_space(partial)
        if full is None:
            return f"rank {rank}: {type(error).__name__}: {error}"
        errno_ = full.errno or errno.ENOSPC  # when the probe's error carries none
        error = OSError(errno_, os.strerror(errno_))  # the probe's name is not news
    return describe_os_error(error, where)


PROBE_BYTES = 1 << 20


def _out_of_space(folder: Path) -> OSError | None:
    """The error a ``PROBE_BYTES`` allocation in ``folder`` fails with when its disk
    (or the user's quota) is full, else None."""
    probe = folder / ".space-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, PROBE_BYTES)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        return exc if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None
    return None
