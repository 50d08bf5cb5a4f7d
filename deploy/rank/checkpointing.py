"""Checkpoints of a job: where each site keeps them, which step a resumed job starts
at, and a rank's restore at start and save after a step (`SiteCheckpoints`).

Every site of a job must start at the same step. `isthmus local --resume` takes the
newest step complete at *any* site: replicas are identical after every step (invariant
1), so a site without it loads another site's checkpoint (its own codec residuals then
start from zero). `isthmus site --resume` takes its own site's newest;
`checkpoint.resume_step` is part of the job fingerprint, so a peer that would start
elsewhere is refused at join. Retention (``checkpoint.keep``) never prunes the newest
step complete at every site whose folder this one sees: a site killed mid-save would
otherwise leave no step both hold (issue 14). With a job token the manifests are signed."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.deploy.config.job import ConfigError, JobConfig
from isthmus.deploy.rank.extras import CODEC, extra_state, load_extra_state

if TYPE_CHECKING:
    from isthmus.deploy.batch.plan import BatchPlan
    from isthmus.inter.data import LaneGradientSync
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


def save_due(config: JobConfig, next_step: int) -> bool:
    """Whether a checkpoint is saved after ``next_step`` steps: every
    ``checkpoint.every``, and after the last step of a run that is kept
    (``checkpoint.final``), so that it keeps its trained model."""
    ck = config.checkpoint
    if ck.every and next_step % ck.every == 0:
        return True
    kept = bool(config.run.run_dir or ck.dir)
    return ck.final and kept and next_step == config.job.steps


@dataclass(frozen=True, slots=True)
class SiteCheckpoints:
    """A rank's checkpoints: its site's folder (`site_root`), the job token that signs
    their manifests (None: unsigned), and what they hold beside the trainer's state
    (extras.py; None where the job has none)."""

    config: JobConfig
    run_dir: Path
    site: str
    key: bytes | None
    sync: LaneGradientSync | None
    outer: OuterOptimizer | None
    plan: BatchPlan | None

    def restore(self, trainer: Trainer) -> int:
        """Load the checkpoint ``checkpoint.resume_step`` names (a collective of the site):
        the site's own if every file matches its manifest, or else the first other site's
        that does (replicas are identical; see the module docstring). Returns the step to
        start at (0 without one)."""
        config, site, step = self.config, self.site, self.config.checkpoint.resume_step
        if step < 0:
            return 0
        from isthmus.intra import checkpoint

        # Each load verifies every file first (rank 0 reads them, the site shares the
        # verdict) and changes nothing when it refuses: so try our copy, then the others'.
        refusals = []
        for source in [site, *(s for s in config.site_names if s != site)]:
            path = checkpoint.step_dir(site_root(config, self.run_dir, source), step)
            try:
                next_step, extra = checkpoint.load(trainer, path, self.key)
                break
            except checkpoint.CheckpointError as exc:
                refusals.append(exc)
                log.warning("[%s] not loading %s: %s", site, path, exc)
        else:
            raise refusals[0]  # this site's own copy names what is wrong
        if source != site:
            # The outer optimizer's state is the same at every site; the codec's is not.
            load_extra_state(extra, None, self.outer, self.plan)
            log.warning(
                "[%s step %d] resumed from %s's checkpoint %s (replicas are identical; this "
                "site's codec residuals start from zero)",
                site,
                next_step,
                source,
                path,
            )
            return next_step
        load_extra_state(extra, self.sync, self.outer, self.plan)
        if self.sync is None and any(k.startswith(CODEC) for k in extra):
            log.warning(
                "[%s step %d] checkpoint holds codec state but the job has one site", site, step
            )
        log.info("[%s step %d] resumed from %s", site, next_step, path)
        return next_step

    def save_if_due(self, trainer: Trainer, next_step: int) -> Path | None:
        """Save after ``next_step`` steps when `save_due` (a collective). Returns the
        committed checkpoint folder, or None when none was due."""
        if not save_due(self.config, next_step):
            return None
        extra = extra_state(self.sync, self.outer, self.plan)
        from isthmus.intra import checkpoint

        protect = common_step(self.config, self.run_dir)  # the step all sites hold now
        return checkpoint.save(
            trainer,
            site_root(self.config, self.run_dir, self.site),
            next_step,
            extra,
            keep=self.config.checkpoint.keep or None,
            protect=protect,
            key=self.key,
        )
