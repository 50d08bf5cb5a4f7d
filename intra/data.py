"""Training data: a byte corpus and stateless, sharded batch sampling.

The default corpus is the Python standard library's source, read as bytes: it is
on every machine without a download. ``ShardedBatches`` draws the batch of step
``s`` from ``(seed, s)`` alone, so the data position *is* the step: resuming (or a
site joining) at step ``s`` needs no sampler state beyond the step counter.

``split_corpus`` holds part of a corpus out: blocks spread evenly over it that no
training window ever touches, from which the held-out (validation) loss is measured.

``prepared_corpus`` reads the folder `isthmus data prepare` writes (deploy/commands/data.py):
uint16 ``.bin`` shards, each the same raw token file ``from_path`` memory-maps, and a
manifest.json; ``ShardedTokens`` reads the shards, memory-mapped, as one sequence.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .user_files import DECODE_ERRORS, decode_problem

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
HELD_OUT_BLOCKS = 8
"""A held-out split is cut as about this many blocks spread evenly over the corpus:
many enough that it samples every part of a corpus ordered by source (the standard
library sorted by path), few and long enough that a window rarely crosses a border."""

Span = tuple[int, int]
"""Token positions ``[start, end)`` of a corpus."""
PREPARED_FORMAT = "isthmus-tokens"
PREPARED_VERSION = 1
"""manifest.json's ``format`` and ``version``: a reader refuses any other."""


class ShardedTokens:
    """Token files read as one 1-D sequence, each memory-mapped: the shards of a prepared
    folder. Indexing by an integer array (``ShardedBatches``' windows, which may cross a
    border between shards) gathers from each file in turn; a slice is copied out."""

    def __init__(self, shards: Sequence[np.ndarray]) -> None:
        if not shards or any(a.ndim != 1 or a.dtype != shards[0].dtype for a in shards):
            raise ValueError("shards must be one or more 1-D arrays of one dtype")
        self.shards = list(shards)
        self.dtype = shards[0].dtype
        self.ndim = 1
        ends = np.cumsum([a.shape[0] for a in shards], dtype=np.int64)
        self._starts = ends - np.array([a.shape[0] for a in shards], dtype=np.int64)
        self.shape = (int(ends[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: np.ndarray | slice) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(self.shape[0])[index]
        flat = np.asarray(index, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"token index out of [0, {self.shape[0]})")
        shard = np.searchsorted(self._starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for k in np.unique(shard):
            mine = shard == k
            out[mine] = self.shards[k][flat[mine] - self._starts[k]]
        return out.reshape(np.shape(index))

    def max(self) -> int:
        return max(int(a.max()) for a in self.shards if a.shape[0])


@dataclass(frozen=True, slots=True)
class Corpus:
    """A flat token sequence (uint8 bytes or uint16 token ids) and where it came from."""

    tokens: np.ndarray | ShardedTokens
    """1-D uint8/uint16 array, possibly a read-only memory map, or memory-mapped shards."""
    name: str
    """Human-readable origin, for logs and job fingerprints."""

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.dtype not in (np.uint8, np.uint16):
            raise ValueError(
                f"corpus tokens must be a 1-D uint8 or uint16 array, got "
                f"shape {self.tokens.shape} dtype {self.tokens.dtype}"
            )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def _read_files(files: list[Path], max_bytes: int) -> np.ndarray:
    out = bytearray()
    for f in files:
        if len(out) >= max_bytes:
            break
        out += f.read_bytes()[: max_bytes - len(out)]
    return np.frombuffer(bytes(out), dtype=np.uint8)


def stdlib_root() -> Path:
    """The folder of this Python's standard library (``stdlib_corpus``'s source)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_name() -> str:
    """``stdlib_corpus``'s name, also for a copy of its bytes read back from a cache."""
    return f"stdlib:{stdlib_root()}"


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The standard library's ``*.py`` files as bytes, sorted by relative path.

    ``site-packages`` is excluded so the corpus does not depend on what is
    installed. The same Python version gives the same bytes on every machine.

    Args:
        max_bytes: cap on the bytes loaded (the last file is truncated).

    Returns:
        The corpus.
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
    root = stdlib_root()
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    return Corpus(tokens=_read_files(files, max_bytes), name=stdlib_name())


def from_path(path: str | Path, *, dtype: str = "uint8", max_bytes: int | None = None) -> Corpus:
    """Load a user corpus.

    Args:
        path: a ``.npy`` token array (its own dtype), a ``.bin`` raw token file
            (memory-mapped, ``dtype``), any other file read as bytes, or a directory
            whose files (recursively, sorted by relative path) are read as bytes.
        dtype: element type of a ``.bin`` file: ``"uint8"`` or ``"uint16"``.
        max_bytes: cap on the bytes read from text files (``None``: no cap).

    Returns:
        The corpus.

    Raises:
        ValueError: on a missing path, an unsupported dtype or an empty corpus.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"corpus path {str(p)!r} does not exist")
    if dtype not in ("uint8", "uint16"):
        raise ValueError(f"corpus dtype must be 'uint8' or 'uint16', got {dtype!r}")
    cap = max_bytes if max_bytes is not None else 1 << 62
    if p.is_dir():
        files = sorted(
            (f for f in p.rglob("*") if f.is_file()), key=lambda f: f.relative_to(p).as_posix()
        )
        tokens = _read_files(files, cap)
    elif p.suffix in (".npy", ".bin"):
        try:
            tokens = (
                np.load(p, mmap_mode="r").reshape(-1)
                if p.suffix == ".npy"
                else np.memmap(p, dtype=np.dtype(dtype), mode="r")
            )
        except DECODE_ERRORS as exc:  # not an .npy, pickled objects, empty, cut short
            raise ValueError(
                f"corpus {str(p)!r} is not {dtype} tokens: {decode_problem(exc)}"
            ) from None
    else:
        tokens = _read_files([p], cap)
    if tokens.shape[0] < 2:
        raise ValueError(f"corpus {str(p)!r} holds {tokens.shape[0]} tokens; need at least 2")
    return Corpus(tokens=tokens, name=str(p))


def read_manifest(folder: str | Path) -> dict:
    """A prepared folder's manifest.json, its format checked.

    Raises:
        ValueError: no such folder or manifest, not JSON, or another format or version.
    """
    path = Path(folder) / "manifest.json"
    if not Path(folder).is_dir():
        raise ValueError(f"prepared data folder {str(folder)!r} does not exist")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{str(folder)!r} has no manifest.json: not a folder `isthmus data prepare` wrote"
        ) from None
    except DECODE_ERRORS as exc:
        raise ValueError(f"{path}: cannot read it ({decode_problem(exc)})") from None
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (
        PREPARED_FORMAT,
        PREPARED_VERSION,
    ):
        raise ValueError(
            f"{path} is not a version-{PREPARED_VERSION} {PREPARED_FORMAT} manifest; "
            "prepare the data again with this release's `isthmus data prepare`"
        )
    return manifest


def prepared_corpus(folder: str | Path) -> tuple[Corpus, dict]:
    """The tokens of a prepared folder, memory-mapped, and its manifest.

    Raises:
        ValueError: as ``read_manifest``, or a shard that is missing or whose size is not
            the manifest's (a folder copied in part, or changed since).
    """
    manifest = read_manifest(folder)
    try:
        dtype = np.dtype(manifest["dtype"])
        entries = [(Path(folder) / e["file"], int(e["tokens"])) for e in manifest["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{Path(folder) / 'manifest.json'} does not list its shards: "
            f"{f'no {exc}' if isinstance(exc, KeyError) else decode_problem(exc)}; "
            "prepare the data again"
        ) from None
    if not entries or dtype not in (np.uint8, np.uint16):
        raise ValueError(
            f"{Path(folder) / 'manifest.json'} lists {len(entries)} shards of {dtype}: "
            "one or more of uint8 or uint16 tokens are needed"
        )
    shards = []
    for path, count in entries:
        size = path.stat().st_size if path.is_file() else -1
        if size != count * dtype.itemsize:
            found = "is missing" if size < 0 else f"holds {size} bytes"
            raise ValueError(
                f"shard {path} {found}, the manifest says {count} {dtype} tokens; "
                "copy the whole folder or prepare it again"
            )
        try:
            shards.append(np.memmap(path, dtype=dtype, mode="r"))
        except DECODE_ERRORS as exc:  # an empty shard cannot be mapped
            raise ValueError(f"shard {path}: {decode_problem(exc)}") from None
    tokens = shards[0] if len(shards) == 1 else ShardedTokens(shards)
    return Corpus(tokens=tokens, name=f"prepared:{folder}"), manifest


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
    """Hold out about ``fraction`` of a corpus of ``n_tokens`` tokens.

    The corpus is cut into blocks, ``HELD_OUT_BLOCKS`` periods of ``round(1/fraction)``
    blocks each; the middle block of every period is held out (so a corpus ordered by
    source is sampled everywhere, not at one end). A corpus too short for that many
    blocks of ``2 * (seq_len + 1)`` tokens holds out its middle block, a larger share.
    The same arguments cut the same split on every machine.

    Args:
        n_tokens: the corpus length.
        fraction: the share to hold out, in [0, 0.5]; 0 holds out nothing.
        seq_len: tokens per training window (a block holds at least two windows).
        bytes_per_token: 1 for a corpus of tokens. A text corpus is cut in bytes before
            it is tokenized (``intra/tokenizer.py``, so no held-out byte reaches a
            tokenizer's training): ``n_tokens`` is then its bytes, and a block holds two
            windows at this many bytes a token.

    Returns:
        The split.

    Raises:
        ValueError: on a fraction outside [0, 0.5], or a corpus too short to split.
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

    Step ``s`` has a global batch of ``num_shards * batch_size`` windows whose
    start offsets are drawn from ``(seed, s)``; shard ``k`` takes the ``k``-th
    contiguous slice of ``batch_size`` windows. So the shards' batches, concatenated
    in shard order, equal the batch of ``num_shards=1`` with
    ``batch_size=num_shards*batch_size``: "2 sites x 1 rank" and "1 site x 2 ranks"
    see the same data. Number shards as ``site_index * dp + dp_rank``.

    With ``spans`` (a ``Split``'s ``train`` or ``held_out``), every window lies inside
    one span, start offsets uniform over the positions where one fits; without, the
    whole corpus is one span.

    With ``units > 1`` the shard takes ``units`` consecutive slices from
    ``shard_index`` on (a rank that accumulates several micro-batches per step; sites
    of different speeds take different counts), so the global batch stays the same set
    of windows however it is split.
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
        if not 0 <= shard_index <= num_shards - units:
            raise ValueError(
                f"shard_index={shard_index} and units={units} must lie in "
                f"[0, num_shards={num_shards})"
            )
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
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        self.seed, self.num_shards = seed, num_shards
        self.shard_index, self.units = shard_index, units

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
        """The corpus offsets of the shard's windows at ``step``."""
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
        """The shard's batch for ``step``.

        Args:
            step: the training step (the data position).

        Returns:
            ``(inputs, targets)``, int64 ``[units * batch_size, seq_len]``; targets are
            inputs shifted by one.
        """
        import torch  # here, not at the top: a launcher loads the corpus without torch

        starts = self.window_starts(step)
        windows = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = torch.from_numpy(self.corpus.tokens[windows].astype(np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
