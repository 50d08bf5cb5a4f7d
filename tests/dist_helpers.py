"""Multi-process helpers for tests on real gloo process groups, and two gradient syncs
(intra.train.GradientSync) for the training step's tests.

Each worker is a process with one thread, forked from a forkserver that has imported
torch and the training code once (``context``); results come back through
``torch.save`` files.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.corpus.tokens import Corpus
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.model_config import ModelConfig
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig, Trainer

COLLECTIVE_TIMEOUT = timedelta(seconds=60)

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch._dynamo",
    "numpy",
    "pytest",
    "isthmus.intra.checkpoint",
    "isthmus.intra.moe_dispatch",
    "isthmus.intra.outer",
    "isthmus.intra.state",
    "isthmus.intra.train",
    "helpers",
    "dist_helpers",
]
"""What the forkserver imports before it forks the first worker. A spawned worker
imported torch and these modules itself, 3-4 s of CPU each on the 2-core CI machine,
every worker of every test; a forked one has them. Importing them starts no thread
and no process group, and torch's intra-op pool starts on a first parallel op, never
at import: the forkserver stays one thread, which is what makes forking it safe."""

_context: BaseContext | None = None


def context() -> BaseContext:
    """The multiprocessing context of the tests' workers: a forkserver (one per pytest
    process, started at its first worker) that has imported ``PRELOAD``. A worker still
    unpickles its function as a spawned one does (the test module is imported again in
    it, from the same ``sys.path`` and working directory)."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def random_corpus() -> Corpus:
    rng = np.random.default_rng(0)
    return Corpus(tokens=rng.integers(0, 256, 20000, dtype=np.uint8), name="random")


def random_batches(
    seq_len: int, batch_size: int, seed: int, shard_index: int = 0, num_shards: int = 1
) -> ShardedBatches:
    """The batches of ``random_corpus``: shard ``shard_index`` of ``num_shards``."""
    return ShardedBatches(
        random_corpus(),
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        shard_index=shard_index,
        num_shards=num_shards,
    )


def site_trainer(
    model: ModelConfig, layout: ParallelLayout, config: TrainConfig, seq_len: int, batch_size: int,
    seed: int,
) -> tuple[Trainer, ShardedBatches]:  # fmt: skip
    """A Trainer of ``model`` (built from ``seed``) on a site mesh of ``layout``, and
    its rank's data-parallel shard of ``random_batches``."""
    trainer = Trainer(build_model(model, seed), build_site_mesh(layout), config)
    dp_rank = trainer.coordinate[1]
    return trainer, random_batches(seq_len, batch_size, seed, dp_rank, layout.dp)


def _in_test_env(fn: Callable[..., Any], env: dict[str, str], args: tuple) -> None:
    # The forkserver's environment is the one it started with (in whichever test that
    # was); a spawned worker had the environment of its own test: ISTHMUS_HOME, a
    # monkeypatched variable.
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    fn(*args)


def process(fn: Callable[..., Any], *args: Any) -> BaseProcess:
    """A daemon worker (not started yet) that runs ``fn(*args)`` with one intra-op
    thread and the environment the test has now, forked from ``context()``."""
    return context().Process(target=_in_test_env, args=(fn, dict(os.environ), args), daemon=True)


def _entry(fn: Callable[..., Any], rank: int, out: str, args: tuple) -> None:
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
    """Run ``fn(rank, *args)`` in ``nprocs`` worker processes; return their results.

    Workers still running ``timeout`` seconds after the start are killed (a hang fails).
    """
    outs = [tmp_path / f"{fn.__name__}-{r}.pt" for r in range(nprocs)]
    procs = [process(_entry, fn, r, str(outs[r]), args) for r in range(nprocs)]
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


def site_world(site: int, sites: int, tmp: str) -> dist.ProcessGroup:
    """Site ``site`` of ``sites`` as its own one-rank torch.distributed world (stores
    under ``tmp``); returned, the gloo group that joins the sites: the "WAN", a group
    FSDP never sees."""
    init_gloo(0, 1, os.path.join(tmp, f"site{site}"))
    cross_store = dist.FileStore(os.path.join(tmp, "cross"), sites)
    return dist.ProcessGroupGloo(cross_store, site, sites, COLLECTIVE_TIMEOUT)


def shutdown() -> None:
    # A rank that tears gloo down while its peer still finishes the last
    # collective can make the peer abort ("terminate called ..."): meet first.
    dist.barrier()
    dist.destroy_process_group()


# -- gradient syncs for tests (isthmus.intra.train.GradientSync) ----------------------


@dataclass(frozen=True)
class SyncDone:
    """What the test syncs' ``finish`` returns (``isthmus.intra.train.SyncResult``)."""

    committed: bool = True


class RecordingSync:
    """Changes nothing; keeps each shard and a copy of it as ``start`` saw it, and the
    steps ``start`` and ``finish`` were called with. ``commit=False`` makes ``finish``
    say the step did not commit (as a lane does when the job went on without a site)."""

    def __init__(self, commit: bool = True) -> None:
        self.commit = commit
        self.shards: dict[int, torch.Tensor] = {}
        self.seen: dict[int, torch.Tensor] = {}
        self.steps: list[tuple[str, int]] = []

    def start(self, step: int, group: int, shard: torch.Tensor) -> None:
        assert group not in self.shards, f"group {group} started twice in one step"
        self.steps.append(("start", step))
        self.shards[group] = shard
        self.seen[group] = shard.clone()

    def finish(self, step: int) -> SyncDone:
        self.steps.append(("finish", step))
        return SyncDone(self.commit)


class AveragingSync:
    """Test-only cross-site sync: a plain gloo all-reduce over its own group, then / sites."""

    def __init__(self, pg: dist.ProcessGroup, sites: int) -> None:
        self.pg, self.sites, self.pending = pg, sites, {}

    def start(self, step: int, group: int, shard: torch.Tensor) -> None:
        assert group not in self.pending
        self.pending[group] = shard

    def finish(self, step: int) -> SyncDone:
        # Work happens here, after the hook returned: this is what proves that an
        # in-place write made later still reaches the optimizer. Group order is
        # fixed so both sites issue matching collectives.
        for group in sorted(self.pending):
            self.pg.allreduce([self.pending[group]]).wait()
            self.pending[group].div_(self.sites)
        self.pending = {}
        return SyncDone()
