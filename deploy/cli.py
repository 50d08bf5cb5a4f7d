"""The `isthmus` command line (`isthmus --help` lists the commands).

Each command is a module, deploy/commands/NAME.py (the table COMMANDS below; a dash in
a command's name is an underscore in its module's); what they share (the config flags,
the help formatter) is deploy/commands/arguments.py, so this module only dispatches: no
command imports it.

Errors a user can fix (a bad key, a layout that does not divide the ranks, a site
with a different job fingerprint) print one line starting with "error:" and exit
non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import os
import signal
import sys
import threading
import time

# gRPC's C core logs connection errors (a peer that already left, a proxy's 502)
# straight to stderr; every failure that matters reaches the user as our own one-line
# error instead. Set before anything imports grpc; GRPC_VERBOSITY=ERROR brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from isthmus.deploy.commands.arguments import (  # noqa: E402
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    HelpFormatter,
)
from isthmus.deploy.config.job import ConfigError  # noqa: E402

# Every subcommand, in the order `isthmus --help` lists them. Each lives in
# deploy/commands/NAME.py, whose `register(sub, formatter)` adds its parser and sets
# `func`, the function `main` calls with the parsed arguments. The modules are
# imported when the parser is built: `isthmus --help` need not import them all first.
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
    "probe",
    "certs",
    "witness",
    "tokenizer",
    "data",
    "export",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isthmus",
        description="Train one model across several datacenters (sites).",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"isthmus.deploy.commands.{name.replace('-', '_')}")
        module.register(sub, HelpFormatter)
        assert name in sub.choices, f"{module.__name__} did not register `isthmus {name}`"
    return parser


TEARDOWN_S = 30.0
"""How long a launcher's teardown may take after the first SIGINT or SIGTERM."""
AGAIN_S = 5.0
"""How long it may take after a further one (Ctrl-C again; a process group's signal
and `timeout`'s both)."""


class Interrupts:
    """SIGINT and SIGTERM: the first unwinds the command like Ctrl-C (its teardown
    stops what it started); later ones do not raise again, which cut the teardown short
    and left a coordinator's server half stopped, up for minutes and holding its ports
    (issue 63). Whatever the teardown does, the process is gone ``TEARDOWN_S`` after
    the first signal and ``AGAIN_S`` after any later one."""

    def __init__(self) -> None:
        self.count = 0
        self._deadline = float("inf")
        self._lock = threading.Lock()

    def __call__(self, signum: int, frame: object) -> None:
        with self._lock:
            self.count += 1
            first = self.count == 1
            self._deadline = min(
                self._deadline, time.monotonic() + (TEARDOWN_S if first else AGAIN_S)
            )
        if first:
            threading.Thread(target=self._exit_by_deadline, name="teardown", daemon=True).start()
            raise KeyboardInterrupt
        print(f"\nstopping (exits within {AGAIN_S:g} s)", file=sys.stderr, flush=True)

    def _exit_by_deadline(self) -> None:
        while (left := self._deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
        print("\nteardown did not end in time: exiting now", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the launcher's teardown runs either way. Ctrl-C
    # works even when started from a script's background job (shells start those with
    # SIGINT ignored, and Python would then never raise KeyboardInterrupt).
    interrupts = Interrupts()
    signal.signal(signal.SIGTERM, interrupts)
    signal.signal(signal.SIGINT, interrupts)
    # `kill -USR1` prints every thread's stack (coordinators, relays) to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A crash in native code (gRPC's, torch's) prints every thread's stack, not only
    # "Segmentation fault".
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # stderr with no file
        faulthandler.enable(all_threads=True)
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
        from isthmus.deploy.launch.ranks import LaunchError
        from isthmus.inter.control.coordinator import CoordinatorError

        if isinstance(exc, (LaunchError, CoordinatorError, RuntimeError, OSError)):
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
