"""A corpus's tokens, read: the default corpus is the Python standard library's source,
read as bytes (it is on every machine without a download); ``from_path`` reads a user's
text or token file; ``prepared_corpus`` reads the folder `isthmus data prepare` writes
(prepare.py): uint16 ``.bin`` shards, each the same raw token file ``from_path``
memory-maps, and a manifest.json; ``ShardedTokens`` reads the shards, memory-mapped, as
one sequence.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..user_files import DECODE_ERRORS, decode_problem

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
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

    tokens: np.ndarray | ShardedTokens  # possibly a read-only memory map
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
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_name() -> str:  # also a cached copy's: the same bytes
    return f"stdlib:{stdlib_root()}"


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The standard library's ``*.py`` files as bytes, sorted by relative path, at most
    ``max_bytes``: the same bytes on every machine with the same Python version
    (``site-packages`` is left out, so what is installed does not matter)."""
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
    root = stdlib_root()
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    return Corpus(tokens=_read_files(files, max_bytes), name=stdlib_name())


def from_path(path: str | Path, *, dtype: str = "uint8", max_bytes: int | None = None) -> Corpus:
    """A user corpus: a ``.npy`` token array (its own dtype), a ``.bin`` raw token file
    (memory-mapped, of ``dtype`` uint8 or uint16), any other file read as bytes, or a
    directory whose files (recursively, sorted by relative path) are read as bytes, at
    most ``max_bytes`` of them. ValueError on a missing path, another dtype, no tokens."""
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
    """A prepared folder's manifest.json, its format and version checked (ValueError)."""
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
    """The tokens of a prepared folder, memory-mapped, and its manifest. ValueError as
    ``read_manifest``, or for a shard missing or not of the manifest's size (a folder
    copied in part, or changed since)."""
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
