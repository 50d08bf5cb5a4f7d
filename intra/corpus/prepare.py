"""`isthmus data prepare` (deploy/commands/data.py): local text, jsonl and parquet files
(read by documents.py) to token shards once.

Every document is encoded with the tokenizer.json (optionally followed by an
end-of-document token) and appended to uint16 ``.bin`` shards, the raw token files
tokens.py memory-maps, beside a manifest.json: the format version, each shard's tokens,
the tokenizer's sha256 (cache.py refuses a job whose data.tokenizer hashes otherwise),
each source file's sha256 and size. The tokenizer.json is copied in, so a job can name it
from the folder. A document is encoded ``BATCH_BYTES`` of pieces at a time, in the pieces
``TextTokenizer.encode`` cuts (``text_pieces``), so the tokens are those of the whole
document and memory stays under ``PEAK_BYTES`` (docs/data.md, "Memory").

The folder is written under a temporary name beside ``--out`` and renamed into place
when complete: a prepare killed midway, or refusing bad input, leaves no ``--out``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from ..user_files import ConfigError
from .documents import DATASETS_HINT, FORMATS, documents
from .tokenizer import PIECE_CHARS, text_pieces
from .tokens import PREPARED_FORMAT, PREPARED_VERSION

if TYPE_CHECKING:
    from .tokenizer import TextTokenizer

__all__ = ["BATCH_BYTES", "DEFAULT_SHARD_TOKENS", "FORMATS", "PEAK_BYTES", "prepare"]

DEFAULT_SHARD_TOKENS = 1 << 28
"""A shard holds at most this many tokens (512 MiB of uint16)."""
BATCH_BYTES = 1 << 20
"""Pieces are encoded together until they hold this many bytes of UTF-8: 16 pieces of
ASCII, one for each of 16 cores. The tokenizer holds ~120 bytes of memory a token while it
encodes them, and a byte is at most one token: ~120 MiB."""
PEAK_BYTES = 256 << 20
"""What a prepare holds at most above the interpreter, its libraries and the tokenizer,
whatever its input or the host's cores: a batch being encoded (~120 MiB), a block read
and decoded, a jsonl line of at most ``LINE_BYTES``; twice the batch, for the allocator's
slack (tests/deploy/test_data_prepare.py measures it; docs/data.md, "Memory")."""


def prepare(
    sources: list[Path],
    tokenizer: Path,
    out: Path,
    *,
    text_field: str = "text",
    eos: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    force: bool = False,
    progress: bool = True,
    batch_bytes: int = BATCH_BYTES,
) -> dict:
    """Tokenize ``sources`` into the folder ``out``; returns its manifest. The tokens do
    not depend on ``batch_bytes`` (tests make it small). ConfigError, leaving nothing
    behind, on a missing or unreadable source, an unknown format, a bad record, no tokens
    at all, an unusable tokenizer, or an ``out`` that exists (without ``force``)."""
    from .tokenizer import TextTokenizer

    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} exists; pass --force to replace it")
    if not sources:
        raise ConfigError("no input files")
    for src in sources:
        if not src.is_file():
            raise ConfigError(f"input {src}: no such file")
        if src.suffix.lower() not in FORMATS:
            known = ", ".join(FORMATS)
            raise ConfigError(f"input {src}: unknown format {src.suffix!r} (known: {known})")
        if FORMATS[src.suffix.lower()] == "parquet" and not importlib.util.find_spec("datasets"):
            raise ConfigError(f"input {src}: parquet needs the datasets package: {DATASETS_HINT}")
    try:
        tok = TextTokenizer.from_file(tokenizer)
    except ValueError as exc:
        raise ConfigError(f"--tokenizer: {exc}") from None
    eos_id = _eos_id(tok, eos)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.preparing."))
    try:
        bar = _Bar(sources, progress)
        manifest = _write(
            sources, tok, tmp, text_field, eos_id, eos, shard_tokens, batch_bytes, bar
        )
        (tmp / "tokenizer.json").write_text(tok.json)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep a shared folder private
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _eos_id(tok: TextTokenizer, eos: str | None) -> int | None:
    if eos is None:
        return None
    value = json.loads(tok.json)
    for added in value.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == eos:
            return int(added["id"])
    vocab = (value.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(eos), int):
        return int(vocab[eos])
    raise ConfigError(f"--eos {eos!r}: the tokenizer has no such token")


def _write(
    sources: list[Path],
    tok: TextTokenizer,
    folder: Path,
    text_field: str,
    eos_id: int | None,
    eos: str | None,
    shard_tokens: int,
    batch_bytes: int,
    bar: _Bar,
) -> dict:
    shards = _Shards(folder, shard_tokens)
    records = []
    documents_in = 0
    try:
        for src in sources:
            digest = hashlib.sha256()
            docs = 0
            for chunks in documents(src, text_field, digest, bar.advance, folder / ".hf-cache"):
                if _encode(tok, chunks, shards, bar, batch_bytes):
                    if eos_id is not None:
                        shards.add(np.array([eos_id], dtype=np.uint16))
                    docs += 1
            if FORMATS[src.suffix.lower()] == "parquet":
                _hash_file(src, digest)
            bar.file_done(src)
            documents_in += docs
            record = {"path": str(src.resolve()), "sha256": digest.hexdigest()}
            records.append(record | {"bytes": src.stat().st_size, "documents": docs})
    finally:
        shards.close()
        bar.finish()
        shutil.rmtree(folder / ".hf-cache", ignore_errors=True)
    if shards.total == 0:
        raise ConfigError(
            f"no tokens: the {len(sources)} input file(s) hold no text"
            + ("" if "jsonl" not in {FORMATS[s.suffix.lower()] for s in sources} else
               f" (jsonl field {text_field!r})")
        )  # fmt: skip
    return {
        "format": PREPARED_FORMAT,
        "version": PREPARED_VERSION,
        "dtype": "uint16",
        "tokens": shards.total,
        "documents": documents_in,
        "shards": shards.entries,
        "tokenizer": {"sha256": tok.sha256, "ids": tok.vocab_size, "file": "tokenizer.json"},
        "eos": None if eos is None else {"token": eos, "id": eos_id},
        "sources": records,
        "validation": "not cut here: a job holds out data.val_fraction of the tokens, blocks "
        "spread evenly over them, cut by train.seq_len (intra/corpus/batches.py split_corpus)",
    }


def _encode(
    tok: TextTokenizer, chunks: Iterable[str], shards: _Shards, bar: _Bar, batch_bytes: int
) -> bool:
    """Encode one document's text chunks onto ``shards``, ``batch_bytes`` of pieces at a
    time; False when it holds no text."""
    batch: list[str] = []
    size = 0
    text = False
    for piece in _pieces(chunks):
        text = True
        batch.append(piece)
        size += len(piece) if piece.isascii() else len(piece.encode("utf-8", "surrogatepass"))
        if size >= batch_bytes:
            shards.add(tok.encode_pieces(batch))
            bar.tokens = shards.total
            batch, size = [], 0
    if batch:
        shards.add(tok.encode_pieces(batch))
        bar.tokens = shards.total
    return text


def _pieces(chunks: Iterable[str], size: int = PIECE_CHARS) -> Iterator[str]:
    """The pieces ``text_pieces`` cuts the chunks' text into, without the text whole: a
    piece is cut only once more than ``size`` characters follow its start (its window is
    then the same), and the rest by ``text_pieces`` itself."""
    text = ""
    for chunk in chunks:
        text += chunk
        start = 0
        while len(text) - start > size:
            end = start + size
            newline = text.rfind("\n", start, end)
            if newline > start:  # as text_pieces: cut after the window's last newline
                end = newline + 1
            yield text[start:end]
            start = end
        text = text[start:]
    yield from text_pieces(text, size)


def _hash_file(src: Path, digest: hashlib._Hash) -> None:
    with open(src, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)


class _Shards:
    """uint16 token files of at most ``limit`` tokens, appended in order."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.entries: list[dict] = []
        self.total = 0
        self._file: BinaryIO | None = None
        self._in_file = 0

    def add(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.uint16)
        while ids.size:
            if self._file is None or self._in_file == self.limit:
                self._open()
            room = self.limit - self._in_file
            part, ids = ids[:room], ids[room:]
            assert self._file is not None
            self._file.write(part.tobytes())
            self._in_file += part.size
            self.entries[-1]["tokens"] = self._in_file
            self.total += part.size

    def _open(self) -> None:
        self.close()
        name = f"shard-{len(self.entries):05d}.bin"
        self._file = open(self.folder / name, "wb")  # noqa: SIM115 - closed in close()
        self._in_file = 0
        self.entries.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


class _Bar:
    """A progress bar on stderr over the input bytes: redrawn in place on a terminal,
    one line at the end otherwise (CI, a pipe)."""

    def __init__(self, sources: list[Path], enabled: bool) -> None:
        self.total = sum(s.stat().st_size for s in sources) or 1
        self.done = self.tokens = self._file_start = 0
        self.enabled, self.tty = enabled, enabled and sys.stderr.isatty()
        self.started, self._drawn = time.perf_counter(), 0.0

    def advance(self, n: int) -> None:
        self.done += n
        if self.tty and time.perf_counter() - self._drawn > 0.2:
            self._draw("\r")

    def file_done(self, src: Path) -> None:
        self._file_start += src.stat().st_size
        self.done = self._file_start  # a parquet file counts when it is read whole
        if self.tty:
            self._draw("\r")

    def finish(self) -> None:
        if self.enabled:
            self._draw("\r" if self.tty else "")
            print(file=sys.stderr, flush=True)

    def _draw(self, start: str) -> None:
        self._drawn = time.perf_counter()
        share = min(1.0, self.done / self.total)
        filled = int(30 * share)
        print(
            f"{start}isthmus data prepare [{'#' * filled}{'.' * (30 - filled)}] "
            f"{share:4.0%} {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, "
            f"{self.tokens:,} tokens, {self._drawn - self.started:.0f} s",
            end="",
            file=sys.stderr,
            flush=True,
        )
