"""A head tied to the embedding across pipeline stages (intra/tied.py) under a cross-site
sync that rounds: two sites of pp=2 on real gloo groups, each site its own world and
each pair of ranks at one coordinate a "WAN" group of its own.

The sync quantizes each 100 values of a shard to a scale of their own, as the int8
codec does per chunk: the first stage's copy of the tied weight starts its flat group,
the last stage's sits behind the final norm's 64 values, so the two copies' rows fall
in other chunks and round apart. Per-step sync sums the copies' gradients after the
rounding (with FSDP2's CPU offload too, on the host gradients), the outer modes
average the copies' outer gradients after it: either way both copies stay bitwise
equal, and so do the sites.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import COLLECTIVE_TIMEOUT, SyncDone, init_gloo, random_batches, shutdown, spawn

from isthmus.intra.layout import ParallelConfig, ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.model_config import preset
from isthmus.intra.outer import OuterConfig, OuterOptimizer
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig, Trainer

SEED, SEQ, BATCH, STEPS = 3, 16, 2, 4
MODEL = replace(preset("tiny"), tie_embeddings=True)
CONFIG = TrainConfig(lr=3e-3, warmup_steps=1, total_steps=STEPS)
PIPELINE = ParallelConfig(schedule="1f1b", microbatches=2)
MODES = ("step", "step-offload", "diloco")
CHUNK = 100  # not a divisor of the norm's 64 values: the copies' rows chunk apart


class ChunkRoundingSync:
    """Cross-site mean of each shard after rounding every ``CHUNK`` values to 8 bits
    of their own scale (the int8 codec's per-chunk loss, without error feedback)."""

    def __init__(self, pg: dist.ProcessGroup, sites: int) -> None:
        self.pg, self.sites, self.pending = pg, sites, {}

    def start(self, step: int, group: int, shard: torch.Tensor) -> None:
        self.pending[group] = shard

    def finish(self, step: int) -> SyncDone:
        for group in sorted(self.pending):  # one order at both sites
            flat = self.pending[group].view(-1)
            for chunk in flat.split(CHUNK):
                scale = chunk.abs().max().clamp_min(1e-30) / 127
                chunk.copy_((chunk / scale).round() * scale)
            self.pg.allreduce([flat]).wait()
            flat.div_(self.sites)
        self.pending = {}
        return SyncDone()


def _copy(trainer: Trainer) -> torch.Tensor:
    assert trainer.tied is not None  # pp=2: every rank holds an end stage
    return trainer.tied.weight.full_tensor().detach().clone()


def _site_rank(site: int, rank: int, tmp: str, mode: str) -> dict[str, Any]:
    init_gloo(rank, 2, os.path.join(tmp, f"{mode}-site{site}"))
    cross = dist.ProcessGroupGloo(
        dist.FileStore(os.path.join(tmp, f"{mode}-cross{rank}"), 2), site, 2, COLLECTIVE_TIMEOUT
    )
    sync = ChunkRoundingSync(cross, 2)
    mesh = build_site_mesh(ParallelLayout(pp=2))
    model = build_model(MODEL, SEED)
    step_sync = sync if mode != "diloco" else None
    # With offload the sync and the copies' sum run on host gradients after backward.
    parallel = replace(PIPELINE, offload=mode == "step-offload")
    trainer = Trainer(model, mesh, CONFIG, parallel=parallel, sync=step_sync)
    outer = None
    if mode == "diloco":
        outer = OuterOptimizer(trainer, sync, OuterConfig(inner_steps=2), total_steps=STEPS)
    data = random_batches(SEQ, BATCH, SEED, site, 2)
    for step in range(STEPS):
        trainer.step(step, *data.batch(step))
        if outer is not None:
            outer.step(step)
    out = {"copy": _copy(trainer), "digest": trainer.parameter_digest()}
    shutdown()
    return out


def _worker(index: int, tmp: str) -> dict[str, dict[str, Any]]:
    site, rank = divmod(index, 2)
    return {mode: _site_rank(site, rank, tmp, mode) for mode in MODES}


@pytest.mark.timeout(120)
def test_tied_copies_and_sites_stay_bitwise_equal_under_a_rounding_sync(tmp_path: Path) -> None:
    ranks = spawn(_worker, 4, tmp_path, str(tmp_path))
    start = build_model(MODEL, SEED).tok_embeddings.weight.detach()
    for mode in MODES:
        (first0, last0), (first1, last1) = (
            [r[mode] for r in ranks[:2]],
            [r[mode] for r in ranks[2:]],
        )
        assert first0["digest"] == first1["digest"], mode  # invariant 1: the sites agree
        for first, last in ((first0, last0), (first1, last1)):
            assert torch.equal(first["copy"], last["copy"]), mode  # embedding == head
        assert not torch.equal(first0["copy"], start), mode  # it trained
