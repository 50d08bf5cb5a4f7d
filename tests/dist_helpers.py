"""Multi-process helpers for tests on real gloo process groups.

Each worker is a spawned process with one thread; results come back through
``torch.save`` files.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from isthmus.intra.data import Corpus

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def random_corpus() -> Corpus:
    rng = np.random.default_rng(0)
    return Corpus(tokens=rng.integers(0, 256, 20000, dtype=np.uint8), name="random")


def _entry(fn: Callable[..., Any], rank: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    torch.save(fn(rank, *args), out)
    # The result is on disk. Leave without the interpreter's teardown: process groups
    # still referenced by meshes and DTensors are then destroyed in no particular order,
    # and gloo now and then aborts there ("terminate called without an active
    # exception", seen once in ~10 CI runs of test_checkpoint), after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    fn: Callable[..., Any], nprocs: int, tmp_path: Path, *args: Any, timeout: float = 90
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; return their results.

    Workers still running ``timeout`` seconds after the start are killed (a hang fails).
    """
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"{fn.__name__}-{r}.pt" for r in range(nprocs)]
    procs = [
        ctx.Process(target=_entry, args=(fn, r, str(outs[r]), args), daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * nprocs, f"worker exit codes {codes}"
    return [torch.load(o, weights_only=False) for o in outs]


def init_gloo(rank: int, world: int, store: str) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )


def shutdown() -> None:
    # A rank that tears gloo down while its peer still finishes the last
    # collective can make the peer abort ("terminate called ..."): meet first.
    dist.barrier()
    dist.destroy_process_group()
