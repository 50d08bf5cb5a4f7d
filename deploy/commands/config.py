"""`isthmus config`: print the resolved job config, every key with its meaning."""

from __future__ import annotations

import argparse
import dataclasses

from isthmus.deploy.commands.arguments import add_config_arguments, config_from_args
from isthmus.deploy.config.job import SECTION_TYPES
from isthmus.deploy.config.sections import field_docs

__all__ = ["register"]


def cmd_config(args: argparse.Namespace) -> int:
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
    """Add `isthmus config` to the CLI."""
    parser = sub.add_parser(
        "config",
        help="print the resolved job config, every key documented",
        description="Print the job config that the given file and overrides resolve "
        "to, as TOML with each key's meaning.",
        formatter_class=formatter,
    )
    add_config_arguments(parser, common_flags=True)
    parser.set_defaults(func=cmd_config)
