"""The README's commands and the launch recipes', as written (README.md, docs/launch.md,
docs/measure.md, docs/configuration.md): every `isthmus ...` line of their bash blocks
parses with the real CLI, and every `isthmus local` example resolves to a job its launch
would accept (config, topology, --slow), without running it. An example that names a setting
the layout refuses (one did, in 2026-11) fails here in seconds instead of in a reader's
terminal."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import ROOT

from isthmus.deploy.cli import build_parser
from isthmus.deploy.commands.arguments import config_from_args
from isthmus.deploy.commands.local import resolve_local_job

PAGES = [
    ROOT / "README.md",
    *(ROOT / "docs" / f for f in ("launch.md", "measure.md", "configuration.md")),
]


def readme_commands() -> list[list[str]]:
    """The argv (after `isthmus`) of every `isthmus` command in the pages' bash blocks:
    continuation lines joined, comments dropped, `a && b` split."""
    commands = []
    text = "\n".join(page.read_text() for page in PAGES)
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["isthmus"]:
                    commands.append(words[1:])
    return commands


def test_the_readme_has_the_examples_this_test_is_for():
    assert len(PAGES[0].read_text().splitlines()) <= 150  # the rest lives in docs/ pages
    commands = readme_commands()
    local = [c for c in commands if c[0] == "local"]
    assert len(local) >= 10, commands  # a change to the extraction must not empty it
    assert ["local"] in commands  # the first command of all
    assert any("--slow" in c for c in local) and any("--topology" in c for c in local)


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_readme_command_parses_and_every_local_example_resolves(argv, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pages' paths are the repository's
    args = build_parser().parse_args(argv)
    if args.command == "local":
        config, _, _ = resolve_local_job(args)
        assert config.site_names
    elif args.command in ("site", "config") and (
        args.config is None or (ROOT / args.config).exists()
    ):
        config_from_args(args)
