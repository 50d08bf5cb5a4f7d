"""`isthmus report`: plot a finished run (deploy/reports/plots.py), or compare several
(deploy/reports/compare.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from isthmus.deploy.commands import add_command
from isthmus.deploy.config.job import ConfigError

__all__ = ["register"]


def cmd_report(args: argparse.Namespace) -> int:
    """plot a finished run, or compare several

    One RUN_DIR: write PNG plots of a finished run (loss; step time stacked into compute,
    intra-site and cross-site; WAN goodput against link capacity) and a short text summary,
    from the files of its --run-dir. Several: overlay them (held-out and training loss
    against tokens and against wall seconds, bytes across sites against tokens) and write
    compare.txt, a table with one row per run and each run's held-out loss relative to the
    first."""
    from isthmus.deploy.reports.compare import write_comparison
    from isthmus.deploy.reports.plots import write_report

    run_dirs = [Path(p) for p in args.run_dirs]
    out = Path(args.out) if args.out else None
    labels = [label.strip() for label in args.labels.split(",")] if args.labels else None
    if len(run_dirs) == 1:
        if labels is not None:
            raise ConfigError("--labels names the runs of a comparison: give two or more RUN_DIRs")
        written = write_report(run_dirs[0], out)
    else:
        written = write_comparison(run_dirs, out, labels)
    for path in written:
        print(f"wrote {path}")
    print(written[-1].read_text(), end="")  # the text: report.txt or compare.txt
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "report", cmd_report)
    add = parser.add_argument
    add(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="finished runs' --run-dir; the first is the baseline of a comparison",
    )
    add(
        "--out",
        help="folder for the plots (default: RUN_DIR with one run, ./isthmus-compare with several)",
    )
    add(
        "--labels",
        metavar="A,B,...",
        help="names of the compared runs, in order (default: the "
        "sync mode, codec, sites x ranks, ... where the runs differ)",
    )
