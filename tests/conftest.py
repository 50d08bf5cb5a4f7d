"""Fixtures that tests of several layers share (tests/<layer>/conftest.py hold a layer's own).

The helper modules next to this file (helpers.py, lanes.py, sockets.py, coordinators.py,
dist_helpers.py, fuzzing.py) are importable from every layer: pyproject's
[tool.pytest.ini_options] puts tests/ on the import path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from isthmus.deploy.commands.certs import write_certs


@pytest.fixture(scope="session", autouse=True)
def isthmus_home(tmp_path_factory) -> Path:
    """The user's job token (deploy/security/token.py) lives here, not in the home folder of
    whoever runs the suite; subprocesses (sites, ranks) inherit it."""
    home = tmp_path_factory.mktemp("isthmus-home")
    os.environ["ISTHMUS_HOME"] = str(home)
    return home


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory) -> Path:
    """The certificates of a job of site0 and site1: a CA, each site's key pair, the token."""
    out = tmp_path_factory.mktemp("job-certs")
    write_certs(out, ["site0", "site1"])
    return out
