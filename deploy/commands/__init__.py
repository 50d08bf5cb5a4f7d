"""The `isthmus` subcommands, one module each; deploy/cli.py dispatches to them.

A command module defines ``register(sub, formatter)``, which adds its parser, and the
functions it runs; the arguments several commands share live in ``arguments.py``. This
module stays light: `python -m isthmus.deploy.commands.wan` imports it without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_command(
    sub: argparse._SubParsersAction,
    formatter: type[argparse.HelpFormatter],
    name: str,
    func: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """Add `name`, run by ``func``, whose docstring says it: its first paragraph is the
    command's line in `isthmus --help`, the rest its description (both empty under
    ``python -OO``, which drops docstrings)."""
    help, _, description = (func.__doc__ or "").partition("\n\n")
    parser = sub.add_parser(
        name,
        help=" ".join(help.split()),
        description=" ".join(description.split()),
        formatter_class=formatter,
    )
    parser.set_defaults(func=func)
    return parser


def add_group(
    sub: argparse._SubParsersAction,
    formatter: type[argparse.HelpFormatter],
    name: str,
    said_by: Callable,
    dest: str,
    metavar: str = "COMMAND",
) -> argparse._SubParsersAction:
    """Add `name`, a command of subcommands that ``said_by``'s docstring says (as
    `add_command`'s ``func``'s); returns the action its subcommands join."""
    parser = add_command(sub, formatter, name, said_by)
    parser.set_defaults(func=None)  # its subcommand's, which a subparser's default sets
    return parser.add_subparsers(dest=dest, metavar=metavar, required=True)
