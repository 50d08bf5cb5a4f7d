"""The `isthmus` subcommands, one module each; deploy/cli.py dispatches to them.

A command module defines ``add_parser(subparsers)`` and the function it runs; the
arguments several commands share live in ``arguments.py``.
"""
