"""Benchmark the cross-site all-reduce over emulated links; prints a table, writes JSON.

Same flags as `isthmus bench allreduce`. The issue 4 acceptance run:

    python benchmarks/allreduce.py --sites 2 --rtt-ms 10 --gbit 1 --mib 256 \\
        --codec raw,int8,int8+zstd:1 --json allreduce-accept.json

needs a host with enough cores (see the printed cores@1G column); the full grid is the
default (`--quick` runs a small one).
"""

from __future__ import annotations

import argparse
import sys

from isthmus.deploy.commands.bench import add_arguments, cmd_bench_allreduce
from isthmus.deploy.config.job import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return cmd_bench_allreduce(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
