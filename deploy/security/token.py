"""The user's job token: made once, kept 0600, read by every site and rank the user starts
(docs/security.md says who requires it and what it signs).

Loopback is every local user's (issue 33: a stranger stopped the two-shell quick start
with one forged call), so a job whose ``[security]`` asks for nothing still runs with
this token. A folder or file that another user owns or can open is refused, never used:
someone who could read it could speak for the job, and someone who wrote it first would
know it."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

__all__ = ["SecretError", "job_token", "secrets_home"]

TOKEN_NAME = "job-token"
HOME_ENV = "ISTHMUS_HOME"


class SecretError(Exception):
    """The token cannot be made or trusted; the message names the path and the fix."""


def secrets_home() -> Path:
    """The folder that holds the user's job token: $ISTHMUS_HOME, else ~/.isthmus."""
    configured = os.environ.get(HOME_ENV)
    return Path(configured) if configured else Path.home() / ".isthmus"


def job_token(home: Path | None = None) -> str:
    """The user's job token, made on first use (256 random bits, URL-safe text). Written
    under a private name, then linked into place (which fails if another process got
    there first), so two sites starting at once read the same token. SecretError when
    the folder or file is not the user's alone, or cannot be made."""
    folder = home if home is not None else secrets_home()
    _private_folder(folder)
    path = folder / TOKEN_NAME
    if not path.exists():
        _create(path)
    return _read(path)


_FIX = (
    f"set {HOME_ENV} to a folder of your own, give the job a token "
    "(isthmus certs; security.require_token, docs/security.md) or pass --insecure"
)


def _private_folder(folder: Path) -> None:
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(folder, follow_symlinks=False)
    except OSError as exc:
        raise SecretError(
            f"cannot make {folder} for the job token: {exc.strerror or exc}; {_FIX}"
        ) from None
    if not stat.S_ISDIR(info.st_mode):
        raise SecretError(f"{folder} is not a folder (a link?); {_FIX}")
    if info.st_uid != os.geteuid():
        raise SecretError(f"{folder} belongs to uid {info.st_uid}, not to you; {_FIX}")
    if info.st_mode & 0o077:
        # Ours but open to others (an old umask, a copied home): close it rather than
        # refuse, since nobody but its owner could have put anything there that counts.
        os.chmod(folder, 0o700)


def _create(path: Path) -> None:
    token = secrets.token_urlsafe(32)
    staging = path.with_name(f".{TOKEN_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(staging, path)  # fails if it exists: the first writer's token stands
    except FileExistsError:
        pass
    except OSError as exc:
        raise SecretError(f"cannot write {path}: {exc.strerror or exc}; {_FIX}") from None
    finally:
        staging.unlink(missing_ok=True)


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SecretError(f"cannot read {path}: {exc.strerror or exc}; {_FIX}") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise SecretError(f"{path} is not a file of yours; remove it or {_FIX}")
        if info.st_mode & 0o077:
            raise SecretError(
                f"{path} can be read or written by others (mode {stat.S_IMODE(info.st_mode):o}): "
                f"its token may be known; remove it to make a new one, or {_FIX}"
            )
        token = f.read().strip()
    if len(token) < 32 or not token.isascii() or not token.isprintable() or " " in token:
        raise SecretError(f"{path} does not hold a job token; remove it to make a new one")
    return token
