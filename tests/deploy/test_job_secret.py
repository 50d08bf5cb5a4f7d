"""The user's job token (deploy/security/token.py): made once, private, never taken from
a file another user could have read or written."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from isthmus.deploy.config.job import load_config
from isthmus.deploy.security.token import TOKEN_NAME, SecretError, job_token
from isthmus.deploy.security.trust import checkpoint_key, site_security

NOBODY = 65534


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


def test_the_token_is_made_once_in_a_private_folder_and_read_back(tmp_path):
    home = tmp_path / "home" / "isthmus"
    token = job_token(home)
    assert len(token) >= 32
    assert mode(home) == 0o700 and mode(home / TOKEN_NAME) == 0o600
    assert job_token(home) == token
    assert sorted(p.name for p in home.iterdir()) == [TOKEN_NAME]  # no staging file left


def test_sites_that_start_at_once_read_one_token(tmp_path):
    home = tmp_path / "isthmus"
    code = "import sys; from isthmus.deploy.security.token import job_token; print(job_token())"
    env = {**os.environ, "ISTHMUS_HOME": str(home)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    tokens = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(tokens) == 1 and len(tokens.pop()) >= 32


def test_an_open_folder_of_ours_is_closed(tmp_path):
    home = tmp_path / "isthmus"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    job_token(home)
    assert mode(home) == 0o700


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda p: os.chmod(p, 0o644), "can be read or written by others (mode 644)"),
        (lambda p: p.write_text("short\n"), "does not hold a job token"),
    ],
)
def test_a_token_file_others_could_know_is_refused_and_left_alone(tmp_path, spoil, why):
    home = tmp_path / "isthmus"
    job_token(home)
    path = home / TOKEN_NAME
    spoil(path)
    before = (path.read_bytes(), mode(path))
    with pytest.raises(SecretError, match="remove it") as refused:
        job_token(home)
    assert why in str(refused.value) and str(path) in str(refused.value)
    assert (path.read_bytes(), mode(path)) == before


def test_a_link_in_the_tokens_place_is_not_followed(tmp_path):
    home = tmp_path / "isthmus"
    home.mkdir(mode=0o700)
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("x" * 43 + "\n")
    os.chmod(elsewhere, 0o600)
    (home / TOKEN_NAME).symlink_to(elsewhere)
    with pytest.raises(SecretError, match="cannot read"):
        job_token(home)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_token_or_folder_another_user_made_first_is_refused(tmp_path):
    """A stranger who creates the file first knows the token: it must not be used."""
    home = tmp_path / "isthmus"
    home.mkdir(mode=0o700)
    planted = home / TOKEN_NAME
    planted.write_text("y" * 43 + "\n")
    os.chmod(planted, 0o600)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(SecretError, match="not a file of yours"):
        job_token(home)
    os.chown(home, NOBODY, NOBODY)
    with pytest.raises(SecretError, match=f"belongs to uid {NOBODY}, not to you"):
        job_token(home)
    assert planted.read_text() == "y" * 43 + "\n"


def test_a_job_without_a_security_section_runs_with_the_users_token(isthmus_home):
    config = load_config(None, ["checkpoint.every=2"])
    security = site_security(config.security, "site0")
    assert security is not None and security.require_token
    assert security.token == job_token()
    assert checkpoint_key(config.security, config.checkpoint) == job_token().encode()
    # A job that neither saves nor resumes needs no key (nor a home folder for it).
    unsaved = load_config(None, [])
    assert checkpoint_key(unsaved.security, unsaved.checkpoint) is None
    # A launcher's run token is used for calls; the checkpoint key stays the user's.
    assert site_security(config.security, "site0", "r" * 43).token == "r" * 43
    # --insecure: no token at all, and unsigned checkpoints.
    insecure = load_config(None, ["security.insecure=true", "checkpoint.every=2"])
    assert (
        site_security(insecure.security, "site0") is None
        and checkpoint_key(insecure.security, insecure.checkpoint) is None
    )
    # The witness never falls back to it (sites of `isthmus local` call it with run tokens).
    assert site_security(config.security, "witness", default_token=False) is None


def test_the_configured_token_signs_checkpoints(job_dir):
    config = load_config(
        None, [f"security.certs_dir={job_dir}", "security.require_token=true", "checkpoint.every=2"]
    )
    assert (
        checkpoint_key(config.security, config.checkpoint)
        == (job_dir / "token").read_text().strip().encode()
    )
