"""The `isthmus` command line.

    isthmus local         every site of a job on this machine, over emulated links
    isthmus site          one site of a job: its coordinator and its ranks
    isthmus coordinator   one site's coordinator, alone
    isthmus config        print the resolved job config with every key documented
    isthmus report        plot a finished run, or compare several
    isthmus chaos         the fault-injection suite: kill, restart, partition, corrupt
    isthmus plan          predict step time and scaling efficiency at any size
    isthmus bench         benchmark the data plane
    isthmus wan           emulate WAN links standalone; show or change them live
    isthmus certs         create a job CA, a certificate per site and a job token
    isthmus witness       the job's witness, which breaks even splits of its sites
    isthmus tokenizer     train the job's BPE tokenizer once, as a tokenizer.json
    isthmus data          tokenize local text/jsonl/parquet files into token shards once
    isthmus export        write a checkpoint in the Hugging Face layout (safetensors)

Each command is a module, deploy/NAME_cmd.py (the table COMMANDS below); this one
holds what they share: the config flags, the help formatter, and the exit codes.

Errors a user can fix (a bad key, a layout that does not divide the ranks, a site
with a different job fingerprint) print one line starting with "error:" and exit
non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

# gRPC's C core logs connection errors (a peer that already left, a proxy's 502)
# straight to stderr; every failure that matters reaches the user as our own one-line
# error instead. Set before anything imports grpc; GRPC_VERBOSITY=ERROR brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from isthmus.deploy.config import ConfigError, JobConfig, load_config  # noqa: E402

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

# Every subcommand, in the order `isthmus --help` lists them. Each lives in
# deploy/NAME_cmd.py, whose `register(sub, formatter)` adds its parser and sets
# `func`, the function `main` calls with the parsed arguments. The modules are
# imported when the parser is built, not with this one: they import its helpers.
COMMANDS = (
    "local",
    "site",
    "coordinator",
    "config",
    "report",
    "chaos",
    "plan",
    "bench",
    "wan",
    "certs",
    "witness",
    "tokenizer",
    "data",
    "export",
)


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
    parser.add_argument(
        "--config",
        metavar="TOML",
        default=None,
        help="job config file (default: built-in defaults, see `isthmus config`)",
    )
    add_set_argument(parser)
    if common_flags:
        defaults = JobConfig()
        parser.add_argument(
            "--sites", type=int, default=None, help=f"sites (default {defaults.topology.sites})"
        )
        parser.add_argument(
            "--ranks-per-site",
            type=str,
            default=None,
            metavar="N|N,M,...",
            help="ranks per site, or one count per site for sites of different sizes "
            f"(4,2) (default {defaults.topology.ranks_per_site})",
        )
        parser.add_argument(
            "--steps", type=int, default=None, help=f"training steps (default {defaults.job.steps})"
        )
        parser.add_argument(
            "--run-dir",
            default=None,
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


def add_insecure_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="let the site listen beyond loopback without mutual TLS and the job token "
        "(warned on every start); without it such a site refuses to start (docs/security.md)",
    )


def add_job_flags(parser: argparse.ArgumentParser, resume_help: str) -> None:
    """The flags every command that runs a job takes (`local`, `site`)."""
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument("--resume", action="store_true", help=resume_help)
    add_insecure_flag(parser)
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="run more CPU ranks on this host than max(8, 4 x its cores); without it such "
        "a job is refused before it starts (run.oversubscribe)",
    )


def run_job(job: Any, heading: str) -> int:
    """Run a `LocalJob` or `SiteJob`, print its summary under ``heading`` and drop its
    run directory if it was a temporary one."""
    from isthmus.deploy.summary import print_summary

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isthmus",
        description="Train one model across several datacenters (sites).",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"isthmus.deploy.{name}_cmd")
        module.register(sub, HelpFormatter)
        assert name in sub.choices, f"{module.__name__} did not register `isthmus {name}`"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the launcher's teardown runs either way. Ctrl-C
    # works even when started from a script's background job (shells start those with
    # SIGINT ignored, and Python would then never raise KeyboardInterrupt).
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # `kill -USR1` prints every thread's stack (coordinators, relays) to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `isthmus config | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; everything this run started has been stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that turns failures into a line
        from isthmus.deploy.ranks import LaunchError
        from isthmus.inter.control.coordinator import CoordinatorError

        if isinstance(exc, (LaunchError, CoordinatorError, RuntimeError, OSError)):
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
