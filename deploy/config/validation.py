"""The checks of a job config that span its sections; each section checks its own
values (``check`` in sections.py and run_sections.py). The job's ``check`` (job.py) runs
them all once every source is applied; each refusal is a ConfigError naming the key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from isthmus.deploy.config.run_sections import RunSection, SyncSection
from isthmus.deploy.config.sections import (
    EVAL_BATCH,
    ConfigError,
    ParallelSection,
    TopologySection,
    TrainSection,
    require,
)
from isthmus.intra.layout import ParallelLayout

if TYPE_CHECKING:
    from isthmus.intra.model_config import ModelConfig

__all__ = ["check_eval_batch", "check_layout", "check_train"]


def check_train(
    t: TopologySection, tr: TrainSection, par: ParallelSection, sync: SyncSection
) -> None:
    """train.accumulate and train.balance_every against the sites, the pipeline and the
    sync mode, and the batch schedule."""
    accumulate = tr.accumulate if isinstance(tr.accumulate, list) else [tr.accumulate]
    require(
        not isinstance(tr.accumulate, list) or len(accumulate) == t.sites,
        f"train.accumulate names {len(accumulate)} values {accumulate} for "
        f"topology.sites={t.sites}: give one per site, or one number for all",
    )
    require(
        max(accumulate) == 1 or (t.pp == 1 and not par.offload),
        f"train.accumulate={tr.accumulate} needs topology.pp=1 and parallel.offload=false "
        f"(got pp={t.pp}, offload={par.offload}): pipelines have micro-batches of their own",
    )
    require(
        tr.balance_every == 0 or (sync.mode == "step" and t.pp == 1 and not par.offload),
        f"train.balance_every={tr.balance_every} needs sync.mode=step, topology.pp=1 and "
        f"parallel.offload=false (got {sync.mode}, pp={t.pp}, "
        f"offload={par.offload}): the split moves micro-batches of per-step sync",
    )
    _check_batch_schedule(t, tr, par, sync)


def _check_batch_schedule(
    t: TopologySection, tr: TrainSection, par: ParallelSection, sync: SyncSection
) -> None:
    """train.batch_schedule's settings (deploy/batch/plan.py)."""
    schedule = tr.batch_schedule
    if schedule == "fixed":
        return
    accumulate, dp = tr.site_accumulate(t.sites), t.site_dp()
    least = sum(dp)
    full = sum(m * d for m, d in zip(accumulate, dp, strict=True))
    require(
        sync.mode == "step" and t.pp == 1 and not par.offload,
        f"train.batch_schedule={schedule} needs sync.mode=step, topology.pp=1 and "
        f"parallel.offload=false (got {sync.mode}, pp={t.pp}, offload={par.offload})",
    )
    start = tr.batch_start or least
    require(
        least <= start < full,
        f"train.batch_start={tr.batch_start} must lie in [{least}, {full}) micro-batches: "
        f"at least one per replica ({least}), below the full batch of train.accumulate "
        f"({full}; raise train.accumulate to leave the batch room to grow)",
    )
    if schedule == "ramp":
        require(
            tr.batch_ramp_steps >= 1,
            f"train.batch_schedule=ramp needs train.batch_ramp_steps >= 1, got {tr.batch_ramp_steps}",
        )
    else:
        require(
            t.sites >= 2 and tr.balance_every >= 1,
            f"train.batch_schedule=noise needs two or more sites and train.balance_every >= 1 "
            f"(got {t.sites} sites, balance_every={tr.balance_every}): each site's own mean "
            "gradient is the estimate's small batch, and the decisions ride on its rounds",
        )


def check_layout(
    t: TopologySection, tr: TrainSection, par: ParallelSection, model: ModelConfig
) -> None:
    """The layout of each site size for the model and its batch."""
    try:
        for ranks in dict.fromkeys(t.site_ranks):  # each size once
            par.config(cuda=False, expert_parallel=t.ep).check(
                ParallelLayout.for_ranks(ranks, pp=t.pp, tp=t.tp, cp=t.cp),
                model,
                batch_size=tr.batch_size,
                seq_len=tr.seq_len,
            )
    except ValueError as exc:
        raise ConfigError(f"parallel: {exc}") from None


def check_eval_batch(t: TopologySection, par: ParallelSection, run: RunSection) -> None:
    """The held-out batch against the pipeline's micro-batches."""
    if t.pp > 1 and run.eval_batches:
        micro = par.config(cuda=False, expert_parallel=t.ep).num_microbatches(t.pp)
        require(
            EVAL_BATCH % micro == 0,
            f"the held-out batch of {EVAL_BATCH} windows is cut into parallel.microbatches="
            f"{micro} with pp > 1, which must divide it: set microbatches to 1, 2, 4 or 8, "
            f"or run.eval_batches=0 (no held-out loss)",
        )
