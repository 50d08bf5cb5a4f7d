"""What the benchmark scripts share: their argument parser's frame and how they write a
result. A script imports it as ``_common``: its own folder is first on sys.path when it
runs, and tests/helpers.py's load_benchmark puts the folder there too."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any


def parser(doc: str | None, out: str | None = None) -> argparse.ArgumentParser:
    """A script's parser: its module docstring, line breaks kept, is its --help text;
    with ``out`` (its help), a first argument --out, the folder the runs go to."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if out is not None:
        p.add_argument("--out", required=True, type=Path, help=out)
    return p


def add_run_arguments(p: argparse.ArgumentParser, name: str, timeout: float, sets: str) -> None:
    """--set (``sets`` says where they go), --json (default OUT/<name>.json) and
    --timeout: the last arguments of a script that runs `isthmus local` jobs."""
    from isthmus.deploy.commands.arguments import add_set_argument  # not every script's need

    add_set_argument(p, help=sets)
    p.add_argument("--json", type=Path, default=None, help=f"default OUT/{name}.json")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds one run may take")


def stamped(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` after the date and the host it was measured on."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(), **result}


def finish_ranks(result: dict[str, Any], json_path: Path | None, print_table) -> None:
    """The end of each rank of a torch.distributed benchmark: rank 0 prints ``result``
    (``print_table``) and writes it to ``json_path`` if one is given; then all leave
    the process group together."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print_table(result)
        if json_path:
            write_json(json_path, result)
    dist.barrier()
    dist.destroy_process_group()


def write_json(path: Path, result: Any) -> Path:
    """``result`` as indented JSON at ``path`` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
