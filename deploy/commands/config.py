"""`isthmus config`: print the resolved job config, every key with its meaning."""

from __future__ import annotations

import argparse
import dataclasses

from isthmus.deploy.commands import add_command
from isthmus.deploy.commands.arguments import add_config_arguments, config_from_args
from isthmus.deploy.config.job import SECTION_TYPES
from isthmus.deploy.config.sections import field_docs

__all__ = ["register"]


def cmd_config(args: argparse.Namespace) -> int:
    """print the resolved job config, every key documented

    Print the job config that the given file and overrides resolve to, as TOML with each
    key's meaning."""
    config = config_from_args(args)
    for section, section_type in SECTION_TYPES.items():
        docs = field_docs(section_type)
        print(f"[{section}]")
        for f in dataclasses.fields(section_type):
            value = getattr(getattr(config, section), f.name)
            rendered = (
                f'"{value}"'
                if isinstance(value, str)
                else str(value).lower()
                if isinstance(value, bool)
                else value
            )
            print(f"{f.name} = {rendered}  # {docs.get(f.name, '')}")
        print()
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "config", cmd_config)
    add_config_arguments(parser, common_flags=True)
