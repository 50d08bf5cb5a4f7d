"""`isthmus coordinator`: one site's coordinator, alone (inter/control/coordinator.py).

Its ranks are started by someone else (Slurm's ``srun`` in
deploy/slurm/site-multinode.sbatch), so no launcher of ours hands them their keys:
with ``--rank-secret-file`` (a 0600 file of random bytes the ranks can read, named to
them in ``ISTHMUS_RANK_SECRET_FILE``) each rank's key derives from it and a stranger
cannot register a rank; without it the first process to register a rank owns it
(inter/control/rank_keys.py), and the coordinator says so when it starts.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from isthmus.deploy.commands import add_command
from isthmus.deploy.commands.arguments import (
    EXIT_FAILED,
    add_config_arguments,
    add_insecure_flag,
    config_from_args,
    read_rank_secret,
)
from isthmus.deploy.config.job import ConfigError
from isthmus.deploy.security.exposure import check_exposure
from isthmus.deploy.security.trust import site_security

__all__ = ["register"]


def cmd_coordinator(args: argparse.Namespace) -> int:
    """run one site's coordinator alone

    Serve one site's coordinator: its ranks register with it, and it joins the peer sites'
    coordinators with the job fingerprint. Exits non-zero with one line when a peer refuses
    the job."""
    from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings

    config = config_from_args(args)
    if args.site not in config.site_names:
        raise ConfigError(f"--site {args.site!r} is not one of {config.site_names}")
    if config.data.tokenizer != "bytes":  # the fingerprint carries the tokenizer's hash
        from isthmus.intra.corpus.cache import pin_tokenizer

        pin_tokenizer(config.data, seq_len=config.train.seq_len)
    # The job config's cluster section, then the flags on top of it.
    listen = args.listen or config.cluster.coordinators.get(args.site, "127.0.0.1:0")
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")
    # Its lanes' exposure too: it is the site's.
    check_exposure(config.security, config.cluster, args.site, host, sys.stderr)
    peers = {s: a for s, a in config.cluster.coordinators.items() if s != args.site}
    peers.update(_pairs(args.peer, "--peer"))
    proxies = {s: u for s, u in config.cluster.proxies.items() if s != args.site and u}
    proxies.update(_pairs(args.proxy, "--proxy"))
    missing = [s for s in config.site_names if s != args.site and s not in peers]
    if missing:
        raise ConfigError(
            f"no coordinator address for {missing}: use --peer SITE=HOST:PORT or cluster.coordinators"
        )
    ranks = config.ranks_of(args.site)
    keys = _rank_keys(args.site, ranks, args.rank_secret_file)
    settings = CoordinatorSettings(
        site=args.site,
        site_names=tuple(config.site_names),
        ranks=ranks,
        site_ranks=tuple(config.site_ranks),
        fingerprint=config.fingerprint(),
        host=host or "127.0.0.1",
        port=int(port or 0),
        join_timeout_s=config.sync.timeout_s,
        metrics_port=None if config.run.metrics_port < 0 else config.run.metrics_port,
        # The job's failover section, as `isthmus site` and `isthmus local` build theirs.
        **config.coordinator_options(),
    )
    coordinator = Coordinator(
        settings,
        peers=peers,
        proxies=proxies,
        security=site_security(config.security, args.site),
        rank_keys=keys,
    )
    coordinator.start()
    print(f"coordinator {args.site} listening on {coordinator.address}", flush=True)
    return _serve(coordinator)


def _rank_keys(site: str, ranks: int, secret_file: str | None):
    from isthmus.inter.control.rank_keys import RankKeys

    if secret_file:
        return RankKeys.derive(site, ranks, read_rank_secret(secret_file))
    print(
        f"warning: {site}'s ranks register first come (no --rank-secret-file): "
        "another local process could register a rank before it starts",
        file=sys.stderr,
    )
    return RankKeys.first_come(site)


def _serve(coordinator) -> int:
    """Until SIGTERM (0), or the coordinator's error or the job's abort (EXIT_FAILED)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.2):
            if coordinator.error:
                print(f"error: {coordinator.error}", file=sys.stderr)
                return EXIT_FAILED
            if coordinator.aborted:  # a script raised, here or at a peer
                if coordinator.aborted_here:
                    coordinator.tell_peers_of_abort()
                print(
                    f"error: the job stopped at every site: {coordinator.aborted}", file=sys.stderr
                )
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


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "coordinator", cmd_coordinator)
    add_config_arguments(parser, common_flags=False)
    add = parser.add_argument
    add("--site", required=True, help="this site's name (site0, site1, ...)")
    add(
        "--listen",
        help="HOST:PORT to serve on (default: cluster.coordinators.SITE, else 127.0.0.1:0)",
    )
    add("--peer", action="append", default=[], metavar="SITE=HOST:PORT", help="a peer coordinator")
    add(
        "--proxy",
        action="append",
        default=[],
        metavar="SITE=URL",
        help="HTTP CONNECT proxy (emulated link) to reach a peer through",
    )
    add(
        "--rank-secret-file",
        metavar="PATH",
        help="0600 file of >= 16 random bytes; ranks that "
        "read it (ISTHMUS_RANK_SECRET_FILE) derive their registration keys from it (default: ranks "
        "register first come)",
    )
    add_insecure_flag(parser)
