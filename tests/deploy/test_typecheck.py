"""mypy over the whole package (intra, inter, deploy, sim; not the generated proto), as
pyproject's [tool.mypy] configures it.

mypy cannot see the editable install's path hook, so it reads the package through a
symlink named ``isthmus`` to the repository (no install step). Its cache lives in the
repository's .mypy_cache (gitignored): cold, a run spends ~30 s reading torch's type
hints; warm, a few seconds.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(240)


def test_package_type_checks(tmp_path):
    (tmp_path / "isthmus").symlink_to(ROOT, target_is_directory=True)
    config, cache = ROOT / "pyproject.toml", ROOT / ".mypy_cache"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(cache)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mypy found errors:\n{output}"
    # Every module of the four packages, so none drops out of the check unnoticed. mypy
    # also counts a folder without __init__.py as a (namespace) package: deploy/k8s and
    # deploy/slurm, which hold manifests.
    packages = [ROOT / name for name in ("intra", "inter", "deploy", "sim")]
    modules = [p for package in packages for p in package.rglob("*.py")]
    folders = [
        d
        for package in packages
        for d in package.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    ]
    checked = re.search(r"Success: no issues found in (\d+) source files", result.stdout)
    assert checked and int(checked[1]) == len(modules) + len(folders), output
