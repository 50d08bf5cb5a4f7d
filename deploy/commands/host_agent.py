"""`isthmus host-agent`: the agent of one node's ranks of a site, for ranks another
program starts (inter/control/host_agent.py).

`isthmus local` and `isthmus site` run one beside the ranks they start. Ranks that
``srun`` starts (deploy/slurm/site-multinode.sbatch) have no launcher of ours on their
node: the template runs this command once a node, and hands the ranks its socket in
``ISTHMUS_HOST_AGENT``. It makes ``--socket-dir`` itself, 0700, and refuses one that
exists (another user could have made it to read the ranks' keys), so only the job's
user reaches the socket. A rank that cannot reach it calls its coordinator. It exits
by itself, removing the folder, once its node's ranks stopped watching or its
coordinator went away (``--exit-after-s``): a scheduler that ends the job kills what is
left of the step soon after its SIGTERM, and the folder would stay behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from isthmus.deploy.commands.arguments import add_config_arguments, config_from_args
from isthmus.deploy.config.job import ConfigError
from isthmus.deploy.security.trust import site_security

__all__ = ["register"]

SOCKET_NAME = "agent"
"""The socket's name in ``--socket-dir``: ranks are handed ``unix:DIR/agent``."""


def make_socket_dir(path: Path) -> None:
    """Creates ``path`` 0700 for this user alone; refuses one that exists."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    except FileExistsError:
        raise ConfigError(
            f"--socket-dir {path} exists: the agent makes it itself (0700) so that no other "
            "user could have; remove it or name another"
        ) from None
    except OSError as exc:
        raise ConfigError(f"--socket-dir {path}: {exc.strerror or exc}") from exc
    os.chmod(path, 0o700)  # whatever the umask


class _Lost:
    """How long the channel to the coordinator has been down, once it was up."""

    def __init__(self, channel) -> None:
        import grpc

        self._up = grpc.ChannelConnectivity.READY
        self._was_up = False
        self._down_since: float | None = None
        channel.subscribe(self._on_state, try_to_connect=True)

    def _on_state(self, state) -> None:
        if state is self._up:
            self._was_up, self._down_since = True, None
        elif self._was_up and self._down_since is None:
            # A connection the coordinator closed goes IDLE, one that cannot be made
            # TRANSIENT_FAILURE: either way the agent's calls are not answered. While
            # its ranks run, its streams and polls keep the channel from idling.
            self._down_since = time.monotonic()

    def for_s(self) -> float:
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since


def cmd_host_agent(args: argparse.Namespace) -> int:
    import grpc

    from isthmus.inter.control.channels import peer_channel
    from isthmus.inter.control.host_agent import HostAgent

    config = config_from_args(args)
    if args.site not in config.site_names:
        raise ConfigError(f"--site {args.site!r} is not one of {config.site_names}")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    if args.ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {args.ranks}")
    socket_dir = Path(args.socket_dir)
    make_socket_dir(socket_dir)
    channel: grpc.Channel | None = None
    agent = None
    try:
        channel = peer_channel(args.coordinator, security=site_security(config, args.site))
        agent = HostAgent(
            channel,
            site=args.site,
            ranks=args.ranks,
            listen=f"unix:{socket_dir / SOCKET_NAME}",
        ).start()
        print(f"host agent of {args.site} listening on {agent.address}", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        lost = _Lost(channel)
        while not stop.wait(0.5):
            # The coordinator gone (the job ended, or its node with it): so is the agent's
            # use, and ending now removes its folder before a scheduler kills the step.
            if lost.for_s() > args.exit_after_s:
                print(f"host agent of {args.site}: coordinator unreachable, exiting", flush=True)
                break
            if agent.idle_for() > args.exit_after_s:  # the node's ranks ended
                print(f"host agent of {args.site}: no rank watches any more, exiting", flush=True)
                break
    finally:
        # The folder first: a scheduler may kill what is left of the step soon after its
        # SIGTERM, and a folder left behind would be refused by the next agent named so.
        shutil.rmtree(socket_dir, ignore_errors=True)
        if agent is not None:
            agent.stop()
            print(f"host agent of {args.site}: {agent.stats()}", flush=True)
        if channel is not None:
            channel.close()
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    """Add `isthmus host-agent` to the CLI."""
    parser = sub.add_parser(
        "host-agent",
        help="run the agent of one node's ranks of a site (for ranks srun starts)",
        description="Serve the votes and watches of one node's ranks of a site at its "
        "coordinator (docs/control-plane.md, 'A host's agent'), on a Unix socket in "
        "--socket-dir, which it makes 0700 and removes at the end; hand the ranks "
        "ISTHMUS_HOST_AGENT=unix:DIR/agent. Stops on SIGTERM or Ctrl-C.",
        formatter_class=formatter,
    )
    add_config_arguments(parser, common_flags=False)
    parser.add_argument("--site", required=True, help="this site's name (site0, site1, ...)")
    parser.add_argument(
        "--coordinator", required=True, metavar="HOST:PORT", help="the site's coordinator"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=8,
        help="the most ranks of the site on this node (a step's ballots go once every rank "
        "watching through the agent voted)",
    )
    parser.add_argument(
        "--socket-dir", required=True, metavar="DIR", help="a folder to make for the socket"
    )
    parser.add_argument(
        "--exit-after-s",
        type=float,
        default=5.0,
        help="exit once the coordinator has been unreachable, or no rank has watched through "
        "the agent, for this long (after both were there)",
    )
    parser.set_defaults(func=cmd_host_agent)
