"""Checkpoints of a job: where each site keeps them, which step a resumed job starts
at, and the two calls the per-rank program makes (restore at start, save after a step).

Every site of a job must start at the same step. `isthmus local --resume` takes the
newest step that is complete at *any* site: replicas are identical after every step
(invariant 1), so a site without that step loads another site's checkpoint of it (its
codec residuals, which are its own, start from zero then). `isthmus site --resume`
takes its own site's newest, and `checkpoint.resume_step` is part of the job
fingerprint, so a peer that would start from another step is refused at join, naming
both steps.

Retention (``checkpoint.keep``) never prunes the newest step complete at every site
whose folder this one can see (the sites of one run directory or checkpoint.dir): a
site killed mid-save, while the other ran on and saved twice more, would otherwise
leave no step both hold (issue 14).

With a job token the manifests are signed with it and checked before a load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.deploy.config.job import ConfigError, JobConfig
from isthmus.deploy.rank.extras import CODEC, extra_state, load_extra_state

if TYPE_CHECKING:
    from isthmus.deploy.batch.plan import BatchPlan
    from isthmus.intra.outer import OuterOptimizer
    from isthmus.intra.train import Trainer

log = logging.getLogger("isthmus.checkpointing")


def site_root(config: JobConfig, run_dir: Path, site: str) -> Path:
    """The site's checkpoint folder: CHECKPOINT_DIR/SITE, or RUN_DIR/checkpoints/SITE."""
    base = Path(config.checkpoint.dir) if config.checkpoint.dir else Path(run_dir) / "checkpoints"
    return base / site


def _run_dir(config: JobConfig) -> Path:
    if not (config.run.run_dir or config.checkpoint.dir):
        raise ConfigError(
            "--resume needs --run-dir (or checkpoint.dir): a temporary run folder holds "
            "no checkpoints"
        )
    return Path(config.run.run_dir or ".").resolve()


def _complete_steps(config: JobConfig, run_dir: Path, sites: list[str]) -> dict[str, set[int]]:
    from isthmus.intra import checkpoint  # torch: only a launcher that resumes pays it

    return {
        s: set(checkpoint.complete_steps(site_root(config, run_dir, s), warn=False)) for s in sites
    }


def common_step(config: JobConfig, run_dir: Path) -> int | None:
    """The newest step complete at every site of the job whose folder is here, or None."""
    steps = [v for v in _complete_steps(config, run_dir, config.site_names).values() if v]
    common = set.intersection(*steps) if steps else set()
    return max(common) if common else None


def resolve_resume(config: JobConfig, sites: list[str], *, resume: bool) -> None:
    """Set ``config.checkpoint.resume_step`` for ``--resume`` (the newest step complete
    at any of ``sites``, those this launcher starts), or check the one given; ConfigError
    on no complete checkpoint, a missing one, or nothing left to train."""
    wanted = config.checkpoint.resume_step
    if not resume and wanted < 0:
        return
    run_dir = _run_dir(config)
    steps = _complete_steps(config, run_dir, sites)
    anywhere = set().union(*steps.values())
    if resume:
        if not anywhere:
            raise ConfigError(
                f"--resume: no complete checkpoint under {site_root(config, run_dir, '*')} "
                f"for {sites}"
            )
        wanted = max(anywhere)
    elif wanted not in anywhere:
        raise ConfigError(
            f"checkpoint.resume_step={wanted}: no complete checkpoint of it at {sites} under "
            f"{site_root(config, run_dir, '*')}"
        )
    if wanted >= config.job.steps:
        raise ConfigError(
            f"the checkpoint to resume from is at step {wanted}, job.steps={config.job.steps}: "
            "nothing left to train (raise --steps)"
        )
    config.checkpoint.resume_step = wanted


def restore(
    trainer: Trainer,
    sync,
    config: JobConfig,
    run_dir: Path,
    site: str,
    key: bytes | None = None,
    outer: OuterOptimizer | None = None,
    plan: BatchPlan | None = None,
) -> int:
    """Load the checkpoint ``checkpoint.resume_step`` names (a collective of the site).

    The site's own checkpoint of that step if every file matches its manifest, or else
    the first other site's that does (replicas are identical; see the module docstring).
    ``sync``, ``outer`` and ``plan``, where given, get their state back; with ``key`` the
    manifest must be signed with it. Returns the step to start at (0 without one)."""
    step = config.checkpoint.resume_step
    if step < 0:
        return 0
    from isthmus.intra import checkpoint

    # Each load verifies every file first (rank 0 reads them, the site shares the
    # verdict) and changes nothing when it refuses: so try our copy, then the others'.
    refusals = []
    for source in [site, *(s for s in config.site_names if s != site)]:
        path = checkpoint.step_dir(site_root(config, run_dir, source), step)
        try:
            next_step, extra = checkpoint.load(trainer, path, key)
            break
        except checkpoint.CheckpointError as exc:
            refusals.append(exc)
            log.warning("[%s] not loading %s: %s", site, path, exc)
    else:
        raise refusals[0]  # this site's own copy names what is wrong
    if source != site:
        # The outer optimizer's state is the same at every site; the codec's is not.
        load_extra_state(extra, None, outer, plan)
        log.warning(
            "[%s step %d] resumed from %s's checkpoint %s (replicas are identical; this "
            "site's codec residuals start from zero)",
            site,
            next_step,
            source,
            path,
        )
        return next_step
    load_extra_state(extra, sync, outer, plan)
    if sync is None and any(k.startswith(CODEC) for k in extra):
        log.warning(
            "[%s step %d] checkpoint holds codec state but the job has one site", site, step
        )
    log.info("[%s step %d] resumed from %s", site, next_step, path)
    return next_step


def save_due(config: JobConfig, next_step: int) -> bool:
    """Whether a checkpoint is saved after ``next_step`` steps: every
    ``checkpoint.every``, and after the last step of a run that is kept
    (``checkpoint.final``), so that it keeps its trained model."""
    ck = config.checkpoint
    if ck.every and next_step % ck.every == 0:
        return True
    kept = bool(config.run.run_dir or ck.dir)
    return ck.final and kept and next_step == config.job.steps


def save_if_due(
    trainer: Trainer,
    sync,
    config: JobConfig,
    run_dir: Path,
    site: str,
    next_step: int,
    key: bytes | None = None,
    outer: OuterOptimizer | None = None,
    plan: BatchPlan | None = None,
) -> Path | None:
    """Save after ``next_step`` steps when ``checkpoint.every`` divides it (a collective);
    the manifest is signed with ``key`` (the job token) when given. Returns the
    committed checkpoint folder, or None when none was due."""
    if not save_due(config, next_step):
        return None
    extra = extra_state(sync, outer, plan)
    from isthmus.intra import checkpoint

    protect = common_step(config, run_dir)  # before this save: the step all sites hold now
    return checkpoint.save(
        trainer,
        site_root(config, run_dir, site),
        next_step,
        extra,
        keep=config.checkpoint.keep or None,
        protect=protect,
        key=key,
    )
