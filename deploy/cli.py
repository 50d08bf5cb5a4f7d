"""The `isthmus` command line.

    isthmus local         every site of a job on this machine, over emulated links
    isthmus site          one site of a job: its coordinator and its ranks
    isthmus coordinator   one site's coordinator, alone
    isthmus config        print the resolved job config with every key documented
    isthmus report        plot a finished run
    isthmus wan           emulate WAN links standalone; show or change them live
    isthmus plan          predict step time and scaling efficiency at any size
    isthmus certs         create a job CA, a certificate per site and a job token
    isthmus tokenizer     train the job's BPE tokenizer once, as a tokenizer.json

Errors a user can fix (a bad key, a layout that does not divide the ranks, a site
with a different job fingerprint) print one line starting with "error:" and exit
non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

# gRPC's C core logs connection errors (a peer that already left, a proxy's 502)
# straight to stderr; every failure that matters reaches the user as our own one-line
# error instead. Set before anything imports grpc; GRPC_VERBOSITY=ERROR brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from isthmus.deploy.config import ConfigError, JobConfig, load_config  # noqa: E402
from isthmus.deploy.exposure import check_exposure  # noqa: E402
from isthmus.deploy.sections import SECTION_TYPES, field_docs  # noqa: E402

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


def add_config_arguments(parser: argparse.ArgumentParser, *, common_flags: bool) -> None:
    parser.add_argument(
        "--config",
        metavar="TOML",
        default=None,
        help="job config file (default: built-in defaults, see `isthmus config`)",
    )
    parser.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override any config key (repeatable); see `isthmus config` for the keys",
    )
    if common_flags:
        defaults = JobConfig()
        parser.add_argument(
            "--sites", type=int, default=None, help=f"sites (default {defaults.topology.sites})"
        )
        parser.add_argument(
            "--ranks-per-site",
            type=int,
            default=None,
            help=f"ranks per site (default {defaults.topology.ranks_per_site})",
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


def config_from_args(args: argparse.Namespace) -> JobConfig:
    flags = {
        "topology.sites": getattr(args, "sites", None),
        "topology.ranks_per_site": getattr(args, "ranks_per_site", None),
        "job.steps": getattr(args, "steps", None),
        "run.run_dir": getattr(args, "run_dir", None),
        "security.insecure": True if getattr(args, "insecure", False) else None,
    }
    return load_config(args.config, args.overrides, flags)


def add_insecure_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="let the site listen beyond loopback without mutual TLS and the job token "
        "(warned on every start); without it such a site refuses to start (docs/security.md)",
    )


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def cmd_local(args: argparse.Namespace) -> int:
    from isthmus.deploy.checkpointing import resolve_resume
    from isthmus.deploy.local import LocalJob
    from isthmus.deploy.summary import print_summary

    topology = None
    if args.topology:
        from isthmus.sim import load_topology

        try:
            topology = load_topology(args.topology)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--topology: {exc}") from None
        if args.sites is None:
            args.sites = len(topology.sites)
    config = config_from_args(args)
    for site in config.site_names:  # coordinators on loopback; lanes on cluster.lane_host
        check_exposure(config, site, "127.0.0.1", sys.stderr)
    resolve_resume(config, config.site_names, resume=args.resume)
    job = LocalJob(config, out=sys.stderr, progress=not args.quiet, topology=topology)
    summary = job.run()
    print("summary:", file=sys.stdout)
    print_summary(summary, sys.stdout, None if job.temporary_run_dir else job.run_dir)
    if job.temporary_run_dir:
        shutil.rmtree(job.run_dir, ignore_errors=True)
    return 0


def cmd_site(args: argparse.Namespace) -> int:
    from isthmus.deploy.checkpointing import resolve_resume
    from isthmus.deploy.site import SiteJob
    from isthmus.deploy.summary import print_summary

    config = config_from_args(args)
    coordinator = config.cluster.coordinators.get(args.site, "127.0.0.1:0")
    check_exposure(config, args.site, _host(coordinator), sys.stderr)
    resolve_resume(config, [args.site], resume=args.resume)
    job = SiteJob(config, args.site, out=sys.stderr, progress=not args.quiet)
    summary = job.run()
    print(f"summary of {args.site}:", file=sys.stdout)
    print_summary(summary, sys.stdout, None if job.temporary_run_dir else job.run_dir)
    if job.temporary_run_dir:
        shutil.rmtree(job.run_dir, ignore_errors=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from isthmus.deploy.report import write_report
    from isthmus.deploy.report_compare import write_comparison

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


def cmd_chaos(args: argparse.Namespace) -> int:
    from isthmus.deploy.chaos import run_suite

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


def cmd_coordinator(args: argparse.Namespace) -> int:
    from isthmus.inter.control.coordinator import Coordinator

    config = config_from_args(args)
    if args.site not in config.site_names:
        raise ConfigError(f"--site {args.site!r} is not one of {config.site_names}")
    if config.data.tokenizer != "bytes":  # the fingerprint carries the tokenizer's hash
        from isthmus.deploy.corpus import pin_tokenizer

        pin_tokenizer(config)
    # The job config's cluster section, then the flags on top of it.
    listen = args.listen or config.cluster.coordinators.get(args.site, "127.0.0.1:0")
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")
    check_exposure(config, args.site, host, sys.stderr)  # its lanes too: it is the site's
    peers = {s: a for s, a in config.cluster.coordinators.items() if s != args.site}
    peers.update(_pairs(args.peer, "--peer"))
    proxies = {s: u for s, u in config.cluster.proxies.items() if s != args.site and u}
    proxies.update(_pairs(args.proxy, "--proxy"))
    missing = [s for s in config.site_names if s != args.site and s not in peers]
    if missing:
        raise ConfigError(
            f"no coordinator address for {missing}: use --peer SITE=HOST:PORT or cluster.coordinators"
        )
    coordinator = Coordinator(
        site=args.site,
        site_names=config.site_names,
        ranks=config.topology.ranks_per_site,
        fingerprint=config.fingerprint(),
        peers=peers,
        proxies=proxies,
        host=host or "127.0.0.1",
        port=int(port or 0),
        join_timeout_s=config.sync.timeout_s,
        metrics_port=None if config.run.metrics_port < 0 else config.run.metrics_port,
        security=config.site_security(args.site),
    )
    coordinator.start()
    print(f"coordinator {args.site} listening on {coordinator.address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.2):
            if coordinator.error:
                print(f"error: {coordinator.error}", file=sys.stderr)
                return EXIT_FAILED
    finally:
        coordinator.stop()
    return 0


def _pairs(items: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{flag} expects NAME=VALUE, got {item!r}")
        out.append((name, value))
    return out


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isthmus",
        description="Train one model across several datacenters (sites).",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    local = sub.add_parser(
        "local",
        help="run every site of a job on this machine over emulated links",
        description="Run a whole job on this machine: one coordinator and one "
        "torch.distributed world per site, ranks as processes (gloo on CPU, NCCL on "
        "GPUs), the sites joined by emulated long-haul links (default 1000 km, "
        "1 Gbit/s). Prints progress, then a summary; --run-dir keeps the files.",
        formatter_class=HelpFormatter,
    )
    add_config_arguments(local, common_flags=True)
    local.add_argument(
        "--topology",
        metavar="TOML",
        default=None,
        help="emulate the links of this topology file (docs/wan.md) instead of the uniform "
        "[wan] settings; its sites become site0, site1, ... in the file's order",
    )
    local.add_argument("--quiet", action="store_true", help="no progress line")
    local.add_argument(
        "--resume",
        action="store_true",
        help="start every site from the newest checkpoint step complete at all of them "
        "(needs --run-dir or checkpoint.dir; docs/checkpoints.md)",
    )
    add_insecure_flag(local)
    local.set_defaults(func=cmd_local)

    site = sub.add_parser(
        "site",
        help="run one site of a job: its coordinator and its ranks",
        description="Run one site of a multi-site job on this machine: serve its "
        "coordinator at cluster.coordinators.SITE, start its ranks, wait for the peer "
        "sites (with a countdown), train, and exit once every site's final parameter "
        "digest is known. Every site needs cluster.coordinators for all sites; "
        "cluster.proxies routes a peer through an emulated link (isthmus wan up).",
        formatter_class=HelpFormatter,
    )
    add_config_arguments(site, common_flags=True)
    site.add_argument("--site", required=True, help="this site's name (site0, site1, ...)")
    site.add_argument("--quiet", action="store_true", help="no progress line")
    site.add_argument(
        "--resume",
        action="store_true",
        help="start from this site's newest complete checkpoint; a peer that would start "
        "from another step is refused at join",
    )
    add_insecure_flag(site)
    site.set_defaults(func=cmd_site)

    coord = sub.add_parser(
        "coordinator",
        help="run one site's coordinator alone",
        description="Serve one site's coordinator: its ranks register with it, and it "
        "joins the peer sites' coordinators with the job fingerprint. Exits non-zero "
        "with one line when a peer refuses the job.",
        formatter_class=HelpFormatter,
    )
    add_config_arguments(coord, common_flags=False)
    coord.add_argument("--site", required=True, help="this site's name (site0, site1, ...)")
    coord.add_argument(
        "--listen",
        default=None,
        help="HOST:PORT to serve on (default: cluster.coordinators.SITE, else 127.0.0.1:0)",
    )
    coord.add_argument(
        "--peer", action="append", default=[], metavar="SITE=HOST:PORT", help="a peer coordinator"
    )
    coord.add_argument(
        "--proxy",
        action="append",
        default=[],
        metavar="SITE=URL",
        help="HTTP CONNECT proxy (emulated link) to reach a peer through",
    )
    add_insecure_flag(coord)
    coord.set_defaults(func=cmd_coordinator)

    show = sub.add_parser(
        "config",
        help="print the resolved job config, every key documented",
        description="Print the job config that the given file and overrides resolve "
        "to, as TOML with each key's meaning.",
        formatter_class=HelpFormatter,
    )
    add_config_arguments(show, common_flags=True)
    show.set_defaults(func=cmd_config)

    report = sub.add_parser(
        "report",
        help="plot a finished run, or compare several",
        description="One RUN_DIR: write PNG plots of a finished run (loss; step time "
        "stacked into compute, intra-site and cross-site; WAN goodput against link "
        "capacity) and a short text summary, from the files of its --run-dir. Several: "
        "overlay them (held-out and training loss against tokens and against wall "
        "seconds, bytes across sites against tokens) and write compare.txt, a table "
        "with one row per run and each run's held-out loss relative to the first.",
        formatter_class=HelpFormatter,
    )
    report.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="finished runs' --run-dir; the first "
        "is the baseline of a comparison"
    )  # fmt: skip
    report.add_argument(
        "--out",
        default=None,
        help="folder for the plots (default: RUN_DIR with one run, ./isthmus-compare with several)",
    )
    report.add_argument(
        "--labels",
        default=None,
        metavar="A,B,...",
        help="names of the compared runs, in order (default: the sync mode, codec, sites x "
        "ranks, ... where the runs differ)",
    )
    report.set_defaults(func=cmd_report)

    chaos = sub.add_parser(
        "chaos",
        help="run the fault-injection suite: kill, restart, partition, corrupt, slow",
        description="Run real jobs (one `isthmus site` process per site over emulated "
        "links) while injecting faults; each scenario passes when every surviving site "
        "finishes with the same parameter digest. Prints a table and writes chaos.json "
        "(docs/reliability.md).",
        formatter_class=HelpFormatter,
    )
    chaos.add_argument("--quick", action="store_true", help="only the quick subset CI runs")
    chaos.add_argument(
        "--only", nargs="+", metavar="NAME", default=None, help="run only these scenarios"
    )
    chaos.add_argument(
        "--keep", metavar="DIR", default=None, help="keep runs and logs here (default: a temp dir)"
    )
    chaos.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the chosen scenarios N times and report how often each passed",
    )
    chaos.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for every site of every scenario, e.g. sync.mode=diloco",
    )
    chaos.set_defaults(func=cmd_chaos)

    from isthmus.deploy import plan_cmd

    plan_cmd.register(sub, HelpFormatter)

    from isthmus.deploy import bench_cmd

    bench_cmd.register(sub, HelpFormatter)

    from isthmus.deploy import wan_cmd

    wan_cmd.register(sub, HelpFormatter)

    from isthmus.deploy import certs_cmd

    certs_cmd.register(sub, HelpFormatter)

    from isthmus.deploy import witness_cmd

    witness_cmd.register(sub, HelpFormatter)

    from isthmus.deploy import tokenizer_cmd

    tokenizer_cmd.register(sub, HelpFormatter)
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
