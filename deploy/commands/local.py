"""`isthmus local`: every site of a job on this machine (deploy/launch/local.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.deploy.commands import add_command
from isthmus.deploy.commands.arguments import (
    add_config_arguments,
    add_job_flags,
    config_from_args,
    run_job,
)
from isthmus.deploy.config.job import ConfigError, JobConfig
from isthmus.deploy.security.exposure import check_exposure

if TYPE_CHECKING:
    from isthmus.sim import Topology

__all__ = ["register", "resolve_local_job"]


def resolve_local_job(
    args: argparse.Namespace, notes: list[str] | None = None
) -> tuple[JobConfig, Topology | None, dict[str, tuple[float, int]]]:
    """The job `isthmus local ARGS` would run: its config, topology and slowed sites,
    checked as a launch checks them, before anything starts (also what the README's
    examples are tested with, tests/deploy/test_readme.py). Settings the job left
    unset are fitted to this host (deploy/launch/quickstart.py); what was chosen is appended
    to ``notes``."""
    from isthmus.deploy.launch.local import host_gpus, parse_slow
    from isthmus.deploy.launch.quickstart import fit_to_host

    def fit(config: JobConfig, given: set[str]) -> None:
        chosen = fit_to_host(config, given, host_gpus(config))
        if notes is not None:
            notes.extend(chosen)

    topology = None
    if args.topology:
        from isthmus.sim import load_topology

        try:
            topology = load_topology(args.topology)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--topology: {exc}") from None
        if args.sites is None:
            args.sites = len(topology.sites)
    config = config_from_args(args, fit=fit)
    return config, topology, parse_slow(args.slow, config.site_names)


def add_script_flag(parser: argparse.ArgumentParser) -> None:
    """``--script PATH [-- ARGS]``: every rank runs the user's script (deploy/api.py)."""
    parser.add_argument(
        "--script",
        metavar="PATH",
        help="run this Python script as every rank "
        "instead of the built-in trainer, as torchrun would; it trains through isthmus.deploy.api "
        "(docs/api.md). Arguments for it follow `--`",
    )
    parser.add_argument("script_args", nargs="*", help=argparse.SUPPRESS)


def use_script(args: argparse.Namespace, config: JobConfig) -> None:
    """Hands ``--script`` to the ranks (they inherit the launcher's environment) and pins
    it in the job: its sha256 and arguments (``run.script_sha256``, ``run.script_args``)
    are part of the fingerprint, so sites running other scripts are refused at join.
    Refuses a missing script, arguments without one, or a script other than the one the
    config pins, before anything starts."""
    import hashlib
    import json
    import os

    from isthmus.deploy.rank.contract import SCRIPT_ENV

    run = config.run
    if args.script is None:
        if args.script_args:
            raise ConfigError(f"unexpected arguments {args.script_args} (no --script)")
        if run.script_sha256 or run.script_args:
            raise ConfigError("run.script_sha256 and run.script_args pin a script: add --script")
        os.environ.pop(SCRIPT_ENV, None)  # the built-in trainer, whatever the shell had
        return
    path = os.path.abspath(args.script)
    try:
        sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        raise ConfigError(f"--script {args.script}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--script {args.script}: {exc.strerror or exc}") from None
    given = json.dumps(list(args.script_args))
    for key, pinned, ours in (
        ("script_sha256", run.script_sha256, sha),
        ("script_args", run.script_args, given),
    ):
        if pinned and pinned != ours:
            raise ConfigError(f"run.{key}: the job pins {pinned}, but --script gives {ours}")
    run.script_sha256, run.script_args = sha, given
    os.environ[SCRIPT_ENV] = json.dumps([path, *args.script_args])


def cmd_local(args: argparse.Namespace) -> int:
    """run every site of a job on this machine over emulated links

    Run a whole job on this machine: one coordinator and one torch.distributed world per
    site, ranks as processes (gloo on CPU, NCCL on GPUs), the sites joined by emulated
    long-haul links (default 1000 km, 1 Gbit/s). Prints progress, then a summary; --run-dir
    keeps the files."""
    from isthmus.deploy.launch.local import LocalJob
    from isthmus.deploy.launch.quickstart import plan_hint
    from isthmus.deploy.rank.checkpointing import resolve_resume

    notes: list[str] = []
    config, topology, slow = resolve_local_job(args, notes)
    use_script(args, config)
    if notes:
        print("isthmus local fitted this host: " + "; ".join(notes), file=sys.stderr)
    hint = plan_hint(config)
    if hint:
        print(hint, file=sys.stderr)
    for site in config.site_names:  # coordinators on loopback; lanes on cluster.lane_host
        check_exposure(config.security, config.cluster, site, "127.0.0.1", sys.stderr)
    resolve_resume(config, config.site_names, resume=args.resume)
    job = LocalJob(config, out=sys.stderr, progress=not args.quiet, topology=topology, slow=slow)
    return run_job(job, "summary:")


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "local", cmd_local)
    add_config_arguments(parser, common_flags=True)
    parser.add_argument(
        "--topology",
        metavar="TOML",
        help="emulate the links of this topology "
        "file (docs/wan.md) instead of the uniform [wan] settings; its sites become site0, site1, "
        "... in the file's order",
    )
    parser.add_argument(
        "--slow",
        metavar="SITE=FACTOR[@STEP]",
        action="append",
        default=[],
        help="make a site's ranks compute FACTOR times slower from STEP on (default 0), "
        "as a site of older GPUs or one that slows while the job runs would; see "
        "train.balance_every",
    )
    add_script_flag(parser)
    add_job_flags(
        parser,
        resume_help="start every site from the newest checkpoint step complete at all of "
        "them (needs --run-dir or checkpoint.dir; docs/checkpoints.md)",
    )
