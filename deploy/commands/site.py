"""`isthmus site`: one site of a job, its coordinator and its ranks, as operators run it.

Each site is started on its own (deploy/launch/site.py); it waits for its peers, trains, and
exits once every site's final parameter digest is known.
"""

from __future__ import annotations

import argparse
import sys

from isthmus.deploy.commands.arguments import (
    add_config_arguments,
    add_job_flags,
    config_from_args,
    run_job,
)
from isthmus.deploy.commands.local import add_script_flag, use_script
from isthmus.deploy.security.exposure import check_exposure

__all__ = ["register"]


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def cmd_site(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.site import SiteJob
    from isthmus.deploy.rank.checkpointing import resolve_resume

    config = config_from_args(args)
    use_script(args, config)
    coordinator = config.cluster.coordinators.get(args.site, "127.0.0.1:0")
    check_exposure(config, args.site, _host(coordinator), sys.stderr)
    resolve_resume(config, [args.site], resume=args.resume)
    job = SiteJob(config, args.site, out=sys.stderr, progress=not args.quiet)
    return run_job(job, f"summary of {args.site}:")


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    """Add `isthmus site` to the CLI."""
    parser = sub.add_parser(
        "site",
        help="run one site of a job: its coordinator and its ranks",
        description="Run one site of a multi-site job on this machine: serve its "
        "coordinator at cluster.coordinators.SITE, start its ranks, wait for the peer "
        "sites (with a countdown), train, and exit once every site's final parameter "
        "digest is known. Every site needs cluster.coordinators for all sites; "
        "cluster.proxies routes a peer through an emulated link (isthmus wan up).",
        formatter_class=formatter,
    )
    add_config_arguments(parser, common_flags=True)
    parser.add_argument("--site", required=True, help="this site's name (site0, site1, ...)")
    add_script_flag(parser)
    add_job_flags(
        parser,
        resume_help="start from this site's newest complete checkpoint; a peer that would "
        "start from another step is refused at join",
    )
    parser.set_defaults(func=cmd_site)
