"""The held-out loss: what the model scores on text it never trained on.

Measured every ``run.eval_every`` steps and after the last, on the same
``run.eval_batches`` batches of ``EVAL_BATCH`` windows of the held-out split every time
and at every site, whatever the per-rank batch, so runs of other layouts compare. The
outer modes measure the sites' *shared* model (the anchors, equal at every site while
their local parameters drift apart), which is also the model a job ends with."""

from __future__ import annotations

import time
from contextlib import nullcontext

from isthmus.deploy.config.run_sections import RunSection
from isthmus.deploy.config.sections import EVAL_BATCH, JobSection
from isthmus.intra.corpus.batches import ShardedBatches, Split
from isthmus.intra.corpus.tokens import Corpus
from isthmus.intra.outer import OuterOptimizer
from isthmus.intra.train import Trainer

__all__ = ["EVAL_BATCH", "EVAL_SEED_OFFSET", "HeldOutLoss"]

EVAL_SEED_OFFSET = 0x5EED
"""Added to job.seed for the held-out windows: a stream the training draws never use."""


class HeldOutLoss:
    """When to measure the held-out loss, and the measurement (a collective of the site:
    every rank calls it at the same steps)."""

    def __init__(
        self, corpus: Corpus, split: Split, run: RunSection, job: JobSection, *, seq_len: int
    ) -> None:
        self.batches_per_eval = run.eval_batches if split.held_out else 0
        self.every, self.last = run.eval_every, job.steps - 1
        self.batches = (
            ShardedBatches(
                corpus,
                seq_len=seq_len,
                batch_size=EVAL_BATCH,
                seed=job.seed + EVAL_SEED_OFFSET,
                spans=split.held_out,
            )
            if self.batches_per_eval
            else None
        )

    def due(self, step: int) -> bool:
        """Whether the loss is measured after ``step``."""
        if self.batches is None:
            return False
        return step == self.last or bool(self.every and (step + 1) % self.every == 0)

    def measure(self, trainer: Trainer, outer: OuterOptimizer | None = None) -> tuple[float, float]:
        """The mean loss over the held-out batches, and the seconds it took. With
        ``outer`` (the outer modes) its anchors, the shared model, are measured in place
        of the local parameters, which are put back."""
        assert self.batches is not None, "no held-out split or no batches asked for"
        started = time.perf_counter()
        with outer.shared_model() if outer is not None else nullcontext():
            total = sum(
                trainer.evaluate(*self.batches.batch(i)) for i in range(self.batches_per_eval)
            )
        return total / self.batches_per_eval, time.perf_counter() - started
