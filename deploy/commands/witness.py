"""`isthmus witness`: the job's witness, a coordinator-only process at a third place
(inter/control/witness.py). It holds no training state and needs no GPU."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.security.exposure import is_loopback
from isthmus.deploy.security.trust import site_security

__all__ = ["register"]


def cmd_witness(args: argparse.Namespace) -> int:
    """run the job's witness, which breaks even splits of its sites

    Serve the job's witness (docs/reliability.md, 'A witness for two sites'): a side holding
    exactly half the sites goes on only with its grant, so two sites survive the loss of
    either. Run it at a third place and name it in every site's failover.witness. With
    mutual TLS it uses the certificate named 'witness' (isthmus certs --sites
    site0,site1,witness). Stops on SIGTERM or Ctrl-C."""
    from isthmus.inter.control.witness import WitnessServer

    flags = {"security.insecure": True if args.insecure else None}
    config = load_config(args.config, args.overrides, flags)
    if config.data.tokenizer != "bytes":  # the fingerprint carries the tokenizer's hash
        from isthmus.intra.corpus.cache import pin_tokenizer

        pin_tokenizer(config.data, seq_len=config.train.seq_len)
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--listen must be HOST:PORT, got {args.listen!r}")
    sec = config.security
    if not is_loopback(host) and not (sec.require_tls and sec.require_token):
        if not sec.insecure:
            raise ConfigError(
                f"the witness would listen on {host} without security.require_tls and "
                "security.require_token: anyone who reaches it could take its grant. Turn "
                "them on (isthmus certs --sites ...,witness; docs/security.md), or pass "
                "--insecure to run it exposed anyway"
            )
        print(f"warning: --insecure: the witness listens on {host} unprotected", file=sys.stderr)
    witness = WitnessServer(
        site_names=config.site_names,
        fingerprint=config.fingerprint(),
        failure_timeout_s=config.failover.failure_timeout_s,
        heartbeat_s=config.failover.heartbeat_s,
        host=host,
        port=int(port),
        security=site_security(config.security, "witness", default_token=False),
    ).start()
    print(f"witness of {', '.join(config.site_names)} listening on {witness.address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        witness.stop()
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    from isthmus.deploy.commands import add_command
    from isthmus.deploy.commands.arguments import add_config_arguments

    parser = add_command(sub, formatter, "witness", cmd_witness)
    add_config_arguments(parser, common_flags=False)
    parser.add_argument(
        "--listen", required=True, metavar="HOST:PORT", help="where to serve (port 0: any)"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback without mutual TLS and the job token (warned)",
    )
