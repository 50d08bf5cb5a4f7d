"""The errors of a checkpoint, without torch: a rank names them in its one error line
(deploy/rank/program.py) whether or not its job checkpoints, and importing
torch.distributed.checkpoint only for their names cost every rank ~35 ms."""

from __future__ import annotations

import errno
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit this trainer."""


def describe_os_error(exc: OSError, path: Path | str | None = None) -> str:
    """One line for a failed file operation: what, the errno's name and the path, e.g.
    ``no space left on device (ENOSPC) writing /run/x.distcp``. A failed ``write()``
    carries no file name: ``path`` then says which file it was."""
    what = (exc.strerror or str(exc)).strip()
    what = what[:1].lower() + what[1:]
    name = errno.errorcode.get(exc.errno or 0)
    where = exc.filename if exc.filename is not None else path
    return f"{what}{f' ({name})' if name else ''}" + (f" writing {where}" if where else "")
