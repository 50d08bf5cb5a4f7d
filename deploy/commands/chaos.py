"""`isthmus chaos`: the fault-injection suite (deploy/chaos/suite.py, docs/reliability.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from isthmus.deploy.commands import add_command
from isthmus.deploy.config.job import ConfigError

__all__ = ["register"]


def cmd_chaos(args: argparse.Namespace) -> int:
    """run the fault-injection suite: kill, restart, partition, corrupt, slow

    Run real jobs (one `isthmus site` process per site over emulated links) while injecting
    faults; each scenario passes when every surviving site finishes with the same parameter
    digest. Prints a table and writes chaos.json (docs/reliability.md)."""
    from isthmus.deploy.chaos.suite import run_suite

    try:
        results = run_suite(
            quick=args.quick,
            only=args.only,
            keep=Path(args.keep) if args.keep else None,
            repeat=args.repeat,
            overrides=tuple(args.set),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return 0 if all(r.ok for r in results) else 1


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "chaos", cmd_chaos)
    add = parser.add_argument
    add("--quick", action="store_true", help="only the quick subset CI runs")
    add("--only", nargs="+", metavar="NAME", help="run only these scenarios")
    add("--keep", metavar="DIR", help="keep runs and logs here (default: a temp dir)")
    add(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the chosen scenarios N times and report how often each passed",
    )
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every site of every scenario, e.g. sync.mode=diloco",
    )
