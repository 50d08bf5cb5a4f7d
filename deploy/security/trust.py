"""Who a job's sites trust, and what signs its checkpoints, from its [security] section.

When the section asks for nothing, calls still carry a token: the launcher's run token,
else the user's job token (deploy/security/token.py), unless ``security.insecure``.
Loopback is every local user's (issue 33). Checkpoint manifests are signed with the
configured job token, else the user's, which outlives a run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.deploy.config.sections import ConfigError
from isthmus.deploy.security.token import SecretError, job_token
from isthmus.inter.security import SiteSecurity

if TYPE_CHECKING:
    from isthmus.deploy.config.run_sections import CheckpointSection, SecuritySection

__all__ = ["checkpoint_key", "site_security"]


def site_security(
    sec: SecuritySection, site: str, run_token: str | None = None, *, default_token: bool = True
) -> SiteSecurity | None:
    """The site's credentials for its servers and channels; None when all is off.
    ``run_token``: the launcher's for this run (ISTHMUS_RUN_TOKEN). ``default_token``
    falls back to the user's job token (not the witness's: its callers may each have a
    run token). ConfigError names a missing file, or a token that cannot be trusted."""
    if not (sec.require_tls or sec.require_token):
        if run_token:
            return SiteSecurity(require_token=True, token=run_token)
        if sec.insecure or not default_token:
            return None
        return SiteSecurity(require_token=True, token=_user_token())
    try:
        return SiteSecurity.load(
            sec.certs_dir,
            site,
            token_file=sec.token_file or None,
            require_tls=sec.require_tls,
            require_token=sec.require_token,
        )
    except ValueError as exc:
        raise ConfigError(f"security: {_with_token_file(exc, sec)}") from None


def _with_token_file(exc: ValueError, sec: SecuritySection) -> str:
    """``exc``'s line, naming the token file when it is about that file's content (the
    check of a token's characters knows no path; issue 63)."""
    path = Path(sec.token_file) if sec.token_file else Path(sec.certs_dir) / "token"
    message = str(exc)
    if sec.require_token and "job token" in message and str(path) not in message:
        return f"{path}: {message}"
    return message


def checkpoint_key(sec: SecuritySection, checkpoint: CheckpointSection) -> bytes | None:
    """What signs checkpoint manifests and checks them on ``--resume``: the configured job
    token, else the user's (it outlives a run, unlike a run token); None when insecure
    with no token, or for a job that neither saves nor resumes."""
    if checkpoint.every <= 0 and checkpoint.resume_step < 0:
        return None
    if sec.require_token:
        try:
            token = SiteSecurity.load(
                sec.certs_dir, "", token_file=sec.token_file or None, require_token=True
            ).token
        except ValueError as exc:
            raise ConfigError(f"security: {_with_token_file(exc, sec)}") from None
        return token.encode() if token else None
    return None if sec.insecure else _user_token().encode()


def _user_token() -> str:
    try:
        return job_token()
    except SecretError as exc:
        raise ConfigError(f"security: {exc}") from None
