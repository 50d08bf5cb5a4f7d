"""Checkpoints of a job: where each site keeps them, which step a resumed job starts
at, and the two calls the per-rank program makes (restore at start, save after a step).

Every site of a job must start at the same step. `isthmus local --resume` takes the
newest step that is complete at *every* site; `isthmus site --resume` takes its own
site's newest, and `checkpoint.resume_step` is part of the job fingerprint, so a
peer that would start from another step is refused at join, naming both steps.
"""

from __future__ import annotations

import logging
from pathlib import Path

from isthmus.deploy.config import ConfigError, JobConfig
from isthmus.intra import checkpoint
from isthmus.intra.train import Trainer

log = logging.getLogger("isthmus.checkpointing")

CODEC = "codec/"


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


def resolve_resume(config: JobConfig, sites: list[str], *, resume: bool) -> None:
    """Set ``config.checkpoint.resume_step`` for ``--resume``, or check the one given.

    Args:
        config: the job config; changed in place.
        sites: the sites this launcher starts (all for `local`, one for `site`).
        resume: ``--resume`` was given: take the newest step complete at every site.

    Raises:
        ConfigError: no common complete checkpoint, a missing one, or nothing left to train.
    """
    wanted = config.checkpoint.resume_step
    if not resume and wanted < 0:
        return
    run_dir = _run_dir(config)
    steps = {s: checkpoint.complete_steps(site_root(config, run_dir, s)) for s in sites}
    if resume:
        common = set.intersection(*(set(v) for v in steps.values()))
        if not common:
            found = {s: sorted(v) for s, v in steps.items()}
            raise ConfigError(
                f"--resume: no checkpoint step is complete at every site under "
                f"{site_root(config, run_dir, '*')} (complete steps: {found})"
            )
        wanted = max(common)
    else:
        missing = [s for s, v in steps.items() if wanted not in v]
        if missing:
            raise ConfigError(
                f"checkpoint.resume_step={wanted}: no complete checkpoint at {missing} under "
                f"{site_root(config, run_dir, '*')}"
            )
    if wanted >= config.job.steps:
        raise ConfigError(
            f"the checkpoint to resume from is at step {wanted}, job.steps={config.job.steps}: "
            "nothing left to train (raise --steps)"
        )
    config.checkpoint.resume_step = wanted


def restore(trainer: Trainer, sync, config: JobConfig, run_dir: Path, site: str) -> int:
    """Load the checkpoint ``checkpoint.resume_step`` names (a collective of the site).

    Args:
        trainer: the rank's fresh trainer.
        sync: the rank's ``LaneGradientSync`` (gets its codec residuals back), or None.

    Returns:
        The step to start at: 0 without a resume step.
    """
    step = config.checkpoint.resume_step
    if step < 0:
        return 0
    path = checkpoint.step_dir(site_root(config, run_dir, site), step)
    next_step, extra = checkpoint.load(trainer, path)
    codec = {k[len(CODEC) :]: v for k, v in extra.items() if k.startswith(CODEC)}
    if sync is not None:
        sync.load_state_dict(codec)
    elif codec:
        log.warning(
            "[%s step %d] checkpoint holds codec state but the job has one site", site, step
        )
    log.info("[%s step %d] resumed from %s", site, next_step, path)
    return next_step


def save_if_due(
    trainer: Trainer, sync, config: JobConfig, run_dir: Path, site: str, next_step: int
) -> Path | None:
    """Save after ``next_step`` steps when ``checkpoint.every`` divides it (a collective).

    Returns:
        The committed checkpoint folder, or None when none was due.
    """
    every = config.checkpoint.every
    if not every or next_step % every:
        return None
    extra = {CODEC + k: v for k, v in sync.state_dict().items()} if sync is not None else None
    return checkpoint.save(
        trainer,
        site_root(config, run_dir, site),
        next_step,
        extra,
        keep=config.checkpoint.keep or None,
    )
