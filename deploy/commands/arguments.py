"""What several `isthmus` commands share: the config flags (``--config``, ``--set``,
...), the help formatter, and running a launcher's job to its summary."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from isthmus.deploy.config.job import ConfigError, JobConfig, load_config

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults and keep the descriptions' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # Unset flags (None) fall back to the config, whose default the help names.
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def add_set_argument(
    parser: argparse.ArgumentParser,
    help: str = "override any config key (repeatable); see `isthmus config` for the keys",
) -> None:
    """``--set SECTION.KEY=VALUE``, repeatable, into ``args.overrides``: the CLI's and
    every benchmark's way of passing config keys on."""
    parser.add_argument(
        "--set", metavar="SECTION.KEY=VALUE", action="append", default=[], dest="overrides",
        help=help,
    )  # fmt: skip


def add_config_arguments(parser: argparse.ArgumentParser, *, common_flags: bool) -> None:
    add = parser.add_argument
    add(
        "--config",
        metavar="TOML",
        help="job config file (default: built-in defaults, see `isthmus config`)",
    )
    add_set_argument(parser)
    if common_flags:
        defaults = JobConfig()
        add("--sites", type=int, help=f"sites (default {defaults.topology.sites})")
        add(
            "--ranks-per-site",
            type=str,
            metavar="N|N,M,...",
            help="ranks per site, or one count per site for sites of different sizes "
            f"(4,2) (default {defaults.topology.ranks_per_site})",
        )
        add("--steps", type=int, help=f"training steps (default {defaults.job.steps})")
        add(
            "--run-dir",
            help="keep the resolved config, metrics.jsonl, summary.json and logs here "
            "(default: a temporary folder, removed after a successful run)",
        )


def config_from_args(
    args: argparse.Namespace, fit: Callable[[JobConfig, set[str]], None] | None = None
) -> JobConfig:
    flags = {
        "topology.sites": getattr(args, "sites", None),
        "topology.ranks_per_site": getattr(args, "ranks_per_site", None),
        "job.steps": getattr(args, "steps", None),
        "run.run_dir": getattr(args, "run_dir", None),
        "security.insecure": True if getattr(args, "insecure", False) else None,
        "run.oversubscribe": True if getattr(args, "oversubscribe", False) else None,
    }
    return load_config(args.config, args.overrides, flags, fit=fit)


def read_rank_secret(path: str) -> bytes:
    """``--rank-secret-file``'s bytes (inter/control/rank_keys.py); ConfigError naming
    the flag when the file is missing, too short or readable by others."""
    from isthmus.inter.control.rank_keys import read_secret

    try:
        return read_secret(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--rank-secret-file: {exc}") from exc


def add_insecure_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="let the site listen beyond "
        "loopback without mutual TLS and the job token (warned on every start); without it such a "
        "site refuses to start (docs/security.md)",
    )


def add_job_flags(parser: argparse.ArgumentParser, resume_help: str) -> None:
    """The flags every command that runs a job takes (`local`, `site`)."""
    add = parser.add_argument
    add("--quiet", action="store_true", help="no progress line")
    add("--resume", action="store_true", help=resume_help)
    add_insecure_flag(parser)
    add(
        "--oversubscribe",
        action="store_true",
        help="run more CPU ranks on this host than max(8, "
        "4 x its cores); without it such a job is refused before it starts "
        "(run.oversubscribe)",
    )


def run_job(job: Any, heading: str) -> int:
    """Run a `LocalJob` or `SiteJob`, print its summary under ``heading`` and drop its
    run directory if it was a temporary one."""
    from isthmus.deploy.reports.summary import print_summary

    # Run folders, resolved configs, logs and checkpoints are the job's state: only their
    # owner may read them (issue 33). The ranks inherit the mask.
    mask = os.umask(0o077)
    try:
        summary = job.run()
    finally:
        os.umask(mask)
    print(heading, file=sys.stdout)
    print_summary(summary, sys.stdout, None if job.temporary_run_dir else job.run_dir)
    if job.temporary_run_dir:
        shutil.rmtree(job.run_dir, ignore_errors=True)
    return 0
