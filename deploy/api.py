"""isthmus's public API for a training script of your own, run as every rank.

``isthmus local --script train.py`` (or ``isthmus site --script train.py``) starts
``train.py`` in every rank of every site, as torchrun would; the coordinators, lanes,
emulated links, failover, metrics and report are the job's as always. The script::

    from isthmus.deploy import api

    ctx = api.init()                                   # this rank's site, rank, mesh
    model = MyNet().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters())
    ctx.attach(model, optimizer)                       # syncs across sites, resumes
    for step in ctx.steps():
        loss = loss_fn(model(x), y)
        loss.backward()
        outcome = ctx.step(loss=loss, tokens=x.numel())  # the optimizer steps on commit
    ctx.finish()

Semantic versioning: the names in ``__all__`` and their documented behaviour are the
API (docs/api.md); anything else here may change.

Underneath, the script's model goes through the built-in trainer's machinery
(deploy/rank/: ``startup``, ``CrossSite``, ``LaneGradientSync`` or the outer optimizer,
checkpoints), and ``steps``, the end of ``step`` and ``finish`` are its ``StepLoop``'s.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from isthmus.deploy.config.job import JobConfig, load_config
from isthmus.deploy.rank.checkpointing import SiteCheckpoints
from isthmus.deploy.rank.loop import StepLine, StepLoop, lane_outcome, outer_step
from isthmus.deploy.rank.script_model import (
    ScriptModel,
    UserState,
    clip_gradients,
    load_parameters,
    script_device,
    site_mean,
)
from isthmus.deploy.rank.startup import (
    RankEnv,
    RankParts,
    at_script_end,
    join_job,
    join_site,
    open_metrics,
    outer_optimizer,
    security_of,
)
from isthmus.deploy.security.trust import checkpoint_key
from isthmus.inter.control.replicas import MAX_LAYOUT_CHARS
from isthmus.inter.metrics import script_metrics_problem
from isthmus.intra.digest import model_layout

if TYPE_CHECKING:
    from isthmus.inter.data import StepOutcome

__all__ = ["Context", "Outcome", "init", "load_parameters"]

SCRIPT_PREFIX = "script/"
"""The script's own numbers (``ctx.step(**more)``) in metrics lines and TensorBoard."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a step ended (``Context.step``)."""

    step: int
    committed: bool
    """Its update was applied at every live site (the optimizer stepped). False: nothing
    of it was applied here (see ``rejoined``)."""
    rejoined: bool = False
    """The job went on without this site while it was cut off: the live state was pulled
    and ``Context.steps`` continues at ``next_step``."""
    next_step: int = 0
    """The step ``Context.steps`` yields next."""


class Context:
    """One rank of the job, as the script sees it (made by :func:`init`).

    Attributes:
        config: the job's resolved config (``config.job.steps``, ``config.sync.mode``...).
        site: this site's name; ``site_index`` its place in ``sites``.
        rank: this rank in its site; ``world_size`` the site's ranks.
        mesh: the site's device mesh, axes ``pp``, ``dp``, ``cp``, ``tp``
            (``fully_shard(block, mesh=ctx.mesh["dp"])`` shards over the site's ranks).
        device: where this rank computes.
        start_step: the first step to train (0, a checkpoint's, or a running job's).
    """

    def __init__(self, env: RankEnv, config: JobConfig) -> None:
        layout = config.site_layout(env.site)
        if (layout.pp, layout.cp, layout.tp) != (1, 1, 1):
            raise ValueError(
                f"--script needs a data-parallel layout (pp=cp=tp=1), got pp={layout.pp} "
                f"cp={layout.cp} tp={layout.tp}"
            )
        self._env, self.config = env, config
        self.site, self.rank, self.world_size = env.site, env.rank, env.world_size
        self.sites = list(config.site_names)
        self.site_index = self.sites.index(env.site)
        self.mesh, _ = join_site(env, config)
        self.device = script_device(self.mesh.device_type)
        self._security = security_of(env, config)
        self._cross = join_job(env, config, self._security)
        self.start_step = 0
        self._loop: StepLoop | None = None

    # --- where this rank's data comes from ---------------------------------------

    def data_shard(self) -> tuple[int, int]:
        """``(index, count)``: this rank's data-parallel shard among every rank of every
        site (site-major), what it should read of the job's data each step."""
        units = self.config.site_units()
        accumulate = self.config.site_accumulate[self.site_index]
        return sum(units[: self.site_index]) + self.rank * accumulate, sum(units)

    def token_batches(self):
        """The job's token data (``[data]`` of the job, the built-in presets' corpus), as
        this rank's shard: ``.batch(step)`` gives ``(inputs, targets)``, resumable."""
        from isthmus.intra.corpus.batches import ShardedBatches
        from isthmus.intra.corpus.cache import load_corpus

        c = self.config
        vocab = c.resolved_model().vocab_size
        corpus, split = load_corpus(c.data, seq_len=c.train.seq_len, vocab=vocab)
        index, count = self.data_shard()
        return ShardedBatches(
            corpus,
            seq_len=c.train.seq_len,
            batch_size=c.train.batch_size,
            seed=c.job.seed,
            shard_index=index,
            num_shards=count,
            units=c.site_accumulate[self.site_index],
            spans=split.train,
        )

    # --- the model ---------------------------------------------------------------

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Makes ``model`` (plain, or sharded with FSDP2's ``fully_shard`` over
        ``mesh["dp"]``) train as one replica across sites in the job's ``sync.mode``, and
        restores a checkpoint (``--resume``) or a running job's state; returns the first
        step to train (also ``start_step``). ``model`` must be identical at every rank at
        start (seed it with ``config.job.seed``); ``optimizer`` is its Adam or AdamW over
        its trainable parameters (ValueError otherwise), stepped by ``step`` only;
        ``state`` holds the script's own tensors to checkpoint and restore in place."""
        if self._loop is not None:
            raise RuntimeError("attach() was called already: one model per job")
        config, env, cross = self.config, self._env, self._cross
        shaped = ScriptModel(model, optimizer, self.mesh["dp"], config.job.steps)
        if cross is not None and config.sync.mode == "step" and shaped.groups:
            # FSDP2 hands each group's reduce-scatter output over during backward, as
            # it does to the built-in trainer: the cross-site rounds overlap backward.
            for i, group in enumerate(shaped.groups):
                group.set_all_reduce_hook(self._hook(shaped, cross.sync, i))
        outer = outer_optimizer(config, shaped, cross)  # type: ignore[arg-type]
        user = UserState(state or {})
        if cross is not None:
            cross.sync.set_site_units(dict(zip(self.sites, config.site_units(), strict=True)))
            cross.plan = user  # type: ignore[assignment]
        site_dir, metrics = open_metrics(env, config, self._security, alone=cross is None)
        sync = cross.sync if cross is not None else None
        key = checkpoint_key(config.security, config.checkpoint)
        checkpoints = SiteCheckpoints(config, env.run_dir, env.site, key, sync, outer, user)  # type: ignore[arg-type]
        start = checkpoints.restore(shaped)  # type: ignore[arg-type]
        if cross is not None:
            start = cross.catch_up(shaped) or start  # type: ignore[arg-type]
            if start == 0:  # a fresh job: every site must start from the same parameters
                digest, layout = shaped.parameter_digest(), model_layout(shaped.model_parts)
                if len(layout) > MAX_LAYOUT_CHARS:
                    layout = ""  # compared by digest alone
                metrics.check_start(digest, layout, wait_s=config.sync.timeout_s)
        dist.barrier()
        parts = RankParts(
            env=env,
            config=config,
            cross=cross,
            sync=sync,
            outer=outer,
            metrics=metrics,
            site_dir=site_dir,
            checkpoints=checkpoints,
            start=start,
            # A script's model stands where the built-in trainer would; the script feeds
            # its own batches and measures its own loss, so those two parts stay unset.
            trainer=shaped,  # type: ignore[arg-type]
            batches=None,  # type: ignore[arg-type]
            held_out=None,  # type: ignore[arg-type]
            plan=user,  # type: ignore[arg-type]
        )
        self._loop = StepLoop(parts)
        self.start_step = start
        return start

    @staticmethod
    def _hook(shaped: ScriptModel, sync, group: int):
        def hook(shard: torch.Tensor) -> None:
            step = shaped.step_in_progress
            if sync.started(step, group):
                # A second backward of the step: said from ctx.step, the script's own frame
                # (raised in FSDP's hook, it would read as a collective's failure).
                shaped.backward_twice = True
                return
            sync.start(step, group, shard)

        return hook

    @contextlib.contextmanager
    def shared_model(self) -> Iterator[None]:
        """Evaluation on the model the sites share (DiLoCo's and streaming's outer model
        of the last outer step; per-step sync's model is always shared), its own
        parameters put back bit for bit after. Evaluate under ``torch.no_grad()``,
        between ``step`` calls; every rank of the site takes part."""
        outer = self._require().parts.outer
        with outer.shared_model() if outer is not None else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block add to the gradients
        without syncing them (an FSDP2 module's reduce-scatter waits too); run every
        micro-batch's but the last inside it, then ``step``. A plain module takes it too."""
        groups = self._require().parts.trainer.groups
        for group in groups:
            group.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for group in groups:
                group.set_requires_gradient_sync(True, recurse=False)

    # --- the loop ------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """The steps to train, from ``start_step`` to ``config.job.steps - 1``; after a
        rejoin it continues where the job is. Call :meth:`step` once per step."""
        yield from self._require().steps()

    def step(
        self,
        *,
        loss: torch.Tensor | float = 0.0,
        tokens: int = 0,
        grad_clip: float | None = None,
        **metrics: float,
    ) -> Outcome:
        """Ends the step after ``loss.backward()``: its gradients are averaged across
        sites (``sync.mode = "step"``) and the optimizer steps once they committed, or
        the site steps alone and the outer round of DiLoCo/streaming runs when due. Then
        the gradients are cleared and the step ends as the built-in trainer's do: paced,
        its metrics written (``loss``, the site's mean, ``tokens``, this rank's, and any
        more numbers), its state offered to a site admitted, a checkpoint saved when due.
        ``grad_clip``: the global norm is clipped to it after the sync (so every site
        clips alike) and reported as ``grad_norm``. ``committed`` is False when nothing
        was applied (the site had to rejoin the job, which ``steps`` then follows)."""
        loop = self._require()
        shaped = loop.parts.trainer
        assert isinstance(shaped, ScriptModel)
        problem = script_metrics_problem(dict.fromkeys(metrics, 0.0))  # names and count
        if problem is not None:
            raise ValueError(f"ctx.step: {problem}")
        if shaped.backward_twice:
            raise RuntimeError(
                "ctx.step: the model's gradients were synced by more than one backward "
                "this step; accumulate micro-batches with `with ctx.no_sync():` around "
                "every backward but the last"
            )
        step = loop.next_step
        compute_s = time.perf_counter() - loop.step_started
        t_sync = time.perf_counter()
        synced, grad_norm = self._apply_gradients(loop.parts, shaped, step, grad_clip)
        sync_s = time.perf_counter() - t_sync

        def measured(traffic: torch.Tensor, slowed: float) -> StepLine:
            site_loss = torch.tensor([float(loss)], dtype=torch.float64)
            dist.all_reduce(site_loss)
            return StepLine(
                loss=float(site_loss) / self.world_size,
                grad_norm=grad_norm,
                lr=shaped.optimizer.param_groups[0].get("lr", 0.0),
                tokens=tokens * self.world_size,
                more={SCRIPT_PREFIX + k: float(v) for k, v in metrics.items()},
            )

        committed = loop.end_step(synced, compute_s, sync_s, measured)
        return Outcome(step, committed=committed, rejoined=not committed, next_step=loop.next_step)

    def _apply_gradients(
        self, parts: RankParts, shaped: ScriptModel, step: int, grad_clip: float | None
    ) -> tuple[StepOutcome | None, float]:
        """The step's sync (per-step, or DiLoCo's outer round when due) and optimizer
        step: what the sync decided, and the gradients' norm (0 unless clipped)."""
        outer = parts.outer
        synced = None
        if parts.sync is not None and outer is None:
            synced = self._sync_step(parts, shaped, step)
        elif not shaped.groups and self.world_size > 1:
            site_mean(shaped.model)  # a plain model: the site's ranks average here
        grad_norm = 0.0
        if synced is None or synced.committed:
            if grad_clip is not None:
                grad_norm = clip_gradients(shaped.model, grad_clip)
            shaped.step_optimizer()
        shaped.optimizer.zero_grad(set_to_none=True)
        if outer is not None:
            return outer_step(parts, step), grad_norm
        return lane_outcome(synced), grad_norm

    @staticmethod
    def _sync_step(parts: RankParts, shaped: ScriptModel, step: int):
        """The step's cross-site gradient average (per-step sync): FSDP2's hooks started
        it during backward; a plain model's gradients go now, as one flat tensor."""
        sync = parts.sync
        assert sync is not None
        flat = piece = None
        if not shaped.groups:
            site_mean(shaped.model)
            grads = [p.grad for p in shaped.model.parameters() if p.grad is not None]
            # Sites of one size: each rank carries its slice of the site's mean across
            # (to the same rank at every site), so the gradient crosses once per site,
            # not once per rank; sites of other sizes pair their ranks otherwise. The
            # flat tensor is built padded to equal slices; a slice is a view of it.
            world, rank = dist.get_world_size(), dist.get_rank()
            sliced = world > 1 and len(set(parts.config.site_ranks)) == 1
            total = sum(g.numel() for g in grads)
            n = -(-total // world) if sliced else total
            pad = grads[0].new_zeros(n * world - total if sliced else 0, dtype=torch.float32)
            flat = torch.cat([*(g.reshape(-1).float() for g in grads), pad])
            piece = flat[rank * n : (rank + 1) * n] if sliced else None
            sync.start(step, 0, flat if piece is None else piece)
        synced = sync.finish(step)
        if flat is not None and synced.committed:
            if piece is not None:
                dist.all_gather(list(flat.chunk(dist.get_world_size())), piece.clone())
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return synced

    def finish(self) -> None:
        """After the last step: the final digest, the rank's result, and the lane,
        coordinator channel and process group closed (what the launcher waits for)."""
        self._require().finish()

    def _require(self) -> StepLoop:
        if self._loop is None:
            raise RuntimeError("call ctx.attach(model, optimizer) first")
        return self._loop


_current: Context | None = None


@contextlib.contextmanager
def _rngs_kept() -> Iterator[None]:
    """Python's, numpy's and torch's (CPU) RNG states as they were before the block: a
    model built after ``init()`` draws what it would have drawn before it, at every rank."""
    import random

    import numpy

    kept = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(kept[0])
        numpy.random.set_state(kept[1])
        torch.set_rng_state(kept[2])


def init() -> Context:
    """This rank's context: joins its site's world and, in a job of several sites, the
    job (its lane and membership). Call once, first, in a script that ``isthmus local
    --script`` or ``isthmus site --script`` started."""
    global _current
    if _current is not None:
        return _current
    if "ISTHMUS_CONFIG" not in os.environ:
        raise RuntimeError(
            "isthmus.deploy.api.init(): not started by isthmus (run the script with "
            "`isthmus local --script PATH`)"
        )
    with _rngs_kept():  # joining draws ports and keys: the script's RNGs stay as seeded
        _current = Context(RankEnv.from_environ(), load_config(Path(os.environ["ISTHMUS_CONFIG"])))
    at_script_end(close_current)
    return _current


def close_current() -> None:
    """Tears the rank down if the script returned without :meth:`Context.finish`."""
    if _current is not None and _current._loop is not None:
        _current.finish()
