"""isthmus.deploy.api and `--script` refuse what they cannot run in one line, before
anything starts, and only the script's own error aborts the job (the scripts themselves
run in tests/e2e/test_script_api.py)."""

from __future__ import annotations

import sys

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


@pytest.mark.parametrize(
    ("body", "aborts"),
    [
        ("raise ValueError('bad batch')", True),  # the script's own error
        ("import sys; sys.exit(3)", True),
        # A collective that fails (here: no process group) is raised inside
        # torch.distributed, as gloo's "Connection closed by peer" is when a rank of the
        # site died: the site's loss, which failover handles, not an abort.
        ("import torch, torch.distributed as d; d.all_reduce(torch.ones(1))", False),
    ],
)
def test_only_the_scripts_own_error_aborts_the_job(tmp_path, monkeypatch, body, aborts):
    from isthmus.deploy.rank.program import ScriptError, run_script

    monkeypatch.setattr("sys.argv", list(sys.argv))
    monkeypatch.setattr("sys.path", list(sys.path))
    script = tmp_path / "train.py"
    script.write_text(body + "\n")
    with pytest.raises(ScriptError) as info:
        run_script([str(script)])
    assert info.value.aborts_job is aborts
    assert str(info.value).startswith(f"{script}: ") or "exited with 3" in str(info.value)


def test_isthmus_own_failures_inside_a_script_pass_through_as_themselves(tmp_path, monkeypatch):
    from isthmus.deploy.rank.program import run_script
    from isthmus.inter.data import QuorumLost

    monkeypatch.setattr("sys.argv", list(sys.argv))
    monkeypatch.setattr("sys.path", list(sys.path))
    script = tmp_path / "train.py"
    script.write_text("from isthmus.inter.data import QuorumLost\nraise QuorumLost('no quorum')\n")
    with pytest.raises(QuorumLost, match="no quorum"):
        run_script([str(script)])
