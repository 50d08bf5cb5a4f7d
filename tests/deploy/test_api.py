"""isthmus.deploy.api and `--script` refuse what they cannot run in one line, before
anything starts (the scripts themselves run in tests/e2e/test_script_api.py)."""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error, run_cli

from isthmus.deploy import api


@pytest.mark.parametrize("command", ["local", "site"])
def test_a_missing_script_is_refused_before_anything_starts(command, tmp_path):
    run_dir = tmp_path / "run"
    site = ["--site", "site0"] if command == "site" else []
    result = run_cli(
        command, *site, "--script", str(tmp_path / "nope.py"), "--run-dir", str(run_dir)
    )
    assert_one_line_error(result, "--script", "nope.py: no such file")
    assert not run_dir.exists()


def test_arguments_without_a_script_are_refused(tmp_path):
    result = run_cli("local", "--run-dir", str(tmp_path / "run"), "--", "--lr", "3")
    assert_one_line_error(result, "unexpected arguments ['--lr', '3'] (no --script)")
    assert not (tmp_path / "run").exists()


def test_init_outside_a_launched_rank_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv("ISTHMUS_CONFIG", raising=False)
    with pytest.raises(RuntimeError, match=r"isthmus local --script PATH"):
        api.init()
