"""Which tokens of a corpus train and which are held out (``split_corpus``: blocks spread
evenly over it that no training window ever touches, from which the held-out loss is
measured), and stateless, sharded batch sampling: ``ShardedBatches`` draws the batch of
step ``s`` from ``(seed, s)`` alone, so the data position *is* the step: resuming (or a
site joining) at step ``s`` needs no sampler state beyond the step counter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from .tokens import Corpus

HELD_OUT_BLOCKS = 8
"""A held-out split is cut as about this many blocks spread evenly over the corpus:
many enough that it samples every part of a corpus ordered by source (the standard
library sorted by path), few and long enough that a window rarely crosses a border."""

Span = tuple[int, int]
"""Token positions ``[start, end)`` of a corpus."""


@dataclass(frozen=True, slots=True)
class Split:
    """Which token positions of a corpus train and which are held out.

    A window of ``seq_len + 1`` tokens is drawn from inside one span, so training never
    reads a held-out token, and the held-out loss is of text the model never saw.
    """

    train: tuple[Span, ...]
    held_out: tuple[Span, ...]

    @classmethod
    def whole(cls, n_tokens: int) -> Split:
        """Everything trains; nothing is held out."""
        return cls(train=((0, n_tokens),), held_out=())

    @property
    def held_out_tokens(self) -> int:
        return sum(end - start for start, end in self.held_out)


def split_corpus(
    n_tokens: int, fraction: float, seq_len: int, *, bytes_per_token: int = 1
) -> Split:
    """Hold out about ``fraction`` (in [0, 0.5]; 0: nothing) of a corpus of ``n_tokens``.

    The corpus is cut into blocks, ``HELD_OUT_BLOCKS`` periods of ``round(1/fraction)``
    blocks each; the middle block of every period is held out (so a corpus ordered by
    source is sampled everywhere, not at one end). A corpus too short for that many
    blocks of ``2 * (seq_len + 1)`` tokens holds out its middle block, a larger share;
    one too short for three blocks is a ValueError. The same arguments cut the same
    split on every machine. A text corpus is cut in bytes before it is tokenized
    (tokenizer.py): ``n_tokens`` is then its bytes, and a block holds two windows at
    ``bytes_per_token``.
    """
    if not 0 <= fraction <= 0.5:
        raise ValueError(f"the held-out fraction must be in [0, 0.5], got {fraction}")
    if fraction == 0:
        return Split.whole(n_tokens)
    period = max(2, round(1 / fraction))
    block = max(2 * (seq_len + 1) * bytes_per_token, n_tokens // (period * HELD_OUT_BLOCKS))
    blocks = n_tokens // block
    if blocks < 3:
        unit = "tokens" if bytes_per_token == 1 else "bytes"
        rate = "" if bytes_per_token == 1 else f" at {bytes_per_token} bytes a token"
        raise ValueError(
            f"a corpus of {n_tokens} {unit} is too short to hold out a split with windows "
            f"of {seq_len + 1} tokens (it needs {3 * block} {unit}{rate}); use a larger "
            f"corpus or data.val_fraction=0 (no held-out loss)"
        )
    held = [i for i in range(blocks) if i % period == period // 2] or [blocks // 2]
    held_out = tuple((i * block, (i + 1) * block) for i in held)
    train, start = [], 0
    for lo, hi in held_out:
        if lo > start:
            train.append((start, lo))
        start = hi
    if start < n_tokens:
        train.append((start, n_tokens))
    return Split(train=tuple(train), held_out=held_out)


class ShardedBatches:
    """Deterministic, stateless batches for one data shard.

    Step ``s`` has a global batch of ``num_shards * batch_size`` windows whose start
    offsets are drawn from ``(seed, s)``; shard ``k`` (``site_index * dp + dp_rank``)
    takes the ``k``-th contiguous slice of ``batch_size`` windows, or ``units`` slices
    from there (a rank that accumulates micro-batches; sites of different speeds take
    different counts). So "2 sites x 1 rank" and "1 site x 2 ranks" see the same data,
    and the global batch is the same set of windows however it is split. With ``spans``
    (a ``Split``'s), every window lies inside one span, its start uniform over where
    one fits; without, the whole corpus is one span.
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        num_shards: int = 1,
        spans: Sequence[Span] | None = None,
        units: int = 1,
    ) -> None:
        if seq_len < 1 or batch_size < 1 or units < 1:
            raise ValueError(
                f"seq_len, batch_size and units must be >= 1, got {seq_len}, {batch_size}, {units}"
            )
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.num_shards = num_shards
        self.resplit(shard_index, units)
        if len(corpus) < seq_len + 1:
            raise ValueError(
                f"corpus {corpus.name!r} has {len(corpus)} tokens, fewer than seq_len+1={seq_len + 1}"
            )
        spans = [(0, len(corpus))] if spans is None else list(spans)
        if any(not 0 <= lo <= hi <= len(corpus) for lo, hi in spans):
            raise ValueError(f"spans must lie in [0, {len(corpus)}], got {spans}")
        # Window starts that fit inside each span, numbered across spans.
        fits = np.array([max(0, hi - lo - seq_len) for lo, hi in spans], dtype=np.int64)
        if fits.sum() == 0:
            raise ValueError(
                f"no window of seq_len+1={seq_len + 1} tokens fits in the spans {spans[:4]} "
                f"of corpus {corpus.name!r}"
            )
        self._span_starts = np.array([lo for lo, _ in spans], dtype=np.int64)
        self._first_index = np.cumsum(fits) - fits
        self._positions = int(fits.sum())
        self.corpus = corpus

    def resplit(self, shard_index: int, units: int, num_shards: int | None = None) -> None:
        """Takes ``units`` slices from ``shard_index`` on, of a global batch of
        ``num_shards`` slices (default: as before), from the next batch on: the sites'
        split of the global batch, or its size, changed (deploy/batch/plan.py)."""
        num_shards = self.num_shards if num_shards is None else num_shards
        if units < 1 or not 0 <= shard_index <= num_shards - units:
            raise ValueError(
                f"shard_index={shard_index} and units={units} must lie in "
                f"[0, num_shards={num_shards})"
            )
        self.shard_index, self.units, self.num_shards = shard_index, units, num_shards

    def window_starts(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        # Draw the whole global batch, then slice: the draw depends only on the global size.
        draws = rng.integers(0, self._positions, size=self.num_shards * self.batch_size)
        first = self.shard_index * self.batch_size
        mine = draws[first : first + self.units * self.batch_size]
        # The span each draw falls in, and the offset inside it (one span: the draw).
        span = np.searchsorted(self._first_index, mine, side="right") - 1
        return self._span_starts[span] + (mine - self._first_index[span])

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's ``(inputs, targets)`` for ``step``: int64 ``[units * batch_size,
        seq_len]``, targets the inputs shifted by one."""
        import torch  # here, not at the top: a launcher loads the corpus without torch

        starts = self.window_starts(step)
        windows = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = torch.from_numpy(self.corpus.tokens[windows].astype(np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
