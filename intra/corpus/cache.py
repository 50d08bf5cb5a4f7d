"""The job's corpus and its held-out split, as the [data] section describes them.

With a BPE tokenizer (data.tokenizer = "bpe" or a tokenizer.json) a text corpus is cut
into held-out and training spans in bytes, the BPE is trained on the training spans
only, and each span is encoded on its own (tokenizer.py). Training a 4096-token
BPE on the 31.5 MB standard library takes ~13 s and encoding it ~22 s on a 2-core
machine, and every rank loads the corpus: both results are cached in data.cache_dir,
keyed by the sha256 of the corpus bytes and the settings, each file written under a
temporary name and renamed into place, so ranks starting together never read half a
file. Launchers load the corpus before they start anything (deploy/launch/local.py,
``check_supported``), so their ranks find the cache filled. The default corpus's own
bytes are kept there too (``_keep_stdlib``), so no rank walks the standard library.

The tokenizer's sha256 is part of the job fingerprint (data.tokenizer_sha256): loading
fills it in, or refuses a tokenizer whose hash differs from the one the job pins.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from ..user_files import ConfigError
from .batches import Split, split_corpus
from .tokenizer import (
    RECIPE,
    TextTokenizer,
    decode_text,
    encode_spans,
    file_facts,
    split_text,
    tokenizer_sha256,
)
from .tokens import Corpus, from_path, prepared_corpus, stdlib_corpus, stdlib_name, stdlib_root


class DataSection(Protocol):
    """The job's [data] section (deploy/config/sections.py documents each key)."""

    source: str
    path: str
    max_bytes: int
    val_fraction: float
    tokenizer: str
    vocab_size: int
    tokenizer_sha256: str
    cache_dir: str


def load_corpus(d: DataSection, *, seq_len: int, vocab: int) -> tuple[Corpus, Split]:
    """The corpus every rank of the job reads, and which of its tokens train and which
    are held out (data.val_fraction, windows of ``seq_len``): the same on every machine
    for the same config. With a BPE tokenizer it fills in data.tokenizer_sha256 when
    empty; a corpus of token ids must fit the model's ``vocab``. ConfigError, naming the
    setting to change, when the corpus cannot be read or split, or the tokenizer is not
    the one data.tokenizer_sha256 pins."""
    try:
        if d.source == "prepared":
            return _prepared(d, seq_len)
        raw = _raw_corpus(d)
        if d.tokenizer == "bytes":
            _check_ids(raw, vocab)
            loaded = raw, split_corpus(len(raw), d.val_fraction, seq_len)
        else:
            loaded = _tokenized(d, seq_len, raw)
        _keep_stdlib(d, raw)
        return loaded
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"data: {exc}") from None


def _prepared(d: DataSection, seq_len: int) -> tuple[Corpus, Split]:
    """A folder of `isthmus data prepare`, refused when it was tokenized by another
    tokenizer than data.tokenizer (its ids would mean other text)."""
    corpus, manifest = prepared_corpus(d.path)
    sha = file_facts(d.tokenizer)[1]
    theirs = manifest["tokenizer"]["sha256"]
    if theirs != sha:
        raise ConfigError(
            f"data.path: {d.path} was prepared with tokenizer sha256 {theirs[:16]}..., but "
            f"data.tokenizer = {d.tokenizer} is {sha[:16]}...: use the tokenizer.json it "
            f"was prepared with ({Path(d.path) / 'tokenizer.json'}) or prepare it again"
        )
    _pin(d, sha)
    return corpus, split_corpus(len(corpus), d.val_fraction, seq_len)


def _check_ids(corpus: Corpus, vocab: int) -> None:
    """Refuse token ids the model's embedding has no row for (a pre-tokenized corpus
    whose vocabulary is larger than data.vocab_size): an index error deep in a rank
    otherwise, or a device-side assert on a GPU."""
    if corpus.tokens.dtype == np.uint8 and vocab >= 256:
        return
    top = int(corpus.tokens.max())
    if top >= vocab:
        raise ConfigError(
            f"data: corpus {corpus.name!r} holds token id {top}, beyond the model's "
            f"vocabulary of {vocab}: set data.vocab_size to at least {top + 1}"
        )


def pin_tokenizer(d: DataSection, *, seq_len: int) -> None:
    """Fill in data.tokenizer_sha256 (a no-op with bytes), for a process that builds the
    job fingerprint without loading the corpus: a standalone coordinator, the witness. A
    tokenizer file is only hashed; a bpe is trained, or found in the cache."""
    if d.tokenizer == "bytes":
        return
    try:
        if d.tokenizer == "bpe":
            json_text = trained_tokenizer(d, seq_len=seq_len)
        else:
            json_text = Path(d.tokenizer).read_text()
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data: {exc}") from None
    _pin(d, tokenizer_sha256(json_text))


def trained_tokenizer(d: DataSection, *, seq_len: int) -> str:
    """The tokenizer.json of the BPE the config's data.vocab_size trains on the training
    split of its corpus (from the cache when it is there); data.tokenizer is not read."""
    try:
        raw = _raw_corpus(d)  # refuses data.source = "prepared": token ids, not text
        byte_split = split_text(len(raw), d.val_fraction, seq_len)
        return _bpe_json(d, raw, byte_split, _corpus_sha256(raw))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"data: {exc}") from None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "isthmus"


# -- the tokenized corpus ---------------------------------------------------------------


def _raw_corpus(d: DataSection) -> Corpus:
    if d.source == "prepared":  # `isthmus tokenizer` on it: its files are token ids
        raise ConfigError(
            'data.source = "prepared" is token ids already; a tokenizer is trained on text '
            '(data.source = "path")'
        )
    if d.source == "stdlib":
        try:
            tokens = np.fromfile(_Cache(d).dir / _stdlib_entry(d), dtype=np.uint8)
        except (FileNotFoundError, NotADirectoryError):
            return stdlib_corpus(d.max_bytes)
        return Corpus(tokens=tokens, name=stdlib_name())
    return from_path(d.path, max_bytes=d.max_bytes)


def _stdlib_entry(d: DataSection) -> str:
    """The cache's copy of the standard library's bytes (``_keep_stdlib``): keyed by the
    library's folder, the Python version and data.max_bytes, for the same install
    gives the same bytes."""
    return "stdlib-" + _key(root=str(stdlib_root()), python=sys.version, max_bytes=d.max_bytes)


def _keep_stdlib(d: DataSection, raw: Corpus) -> None:
    """Keep a copy of the standard library's bytes in the cache, once the job they are
    for has passed every check (a refused job writes nothing). Every rank and its
    launcher load the corpus: walking the library's ~1,800 files took 0.7 s of each
    one's start-up on a 2-core machine, reading the copy 0.02 s. Best effort: a cache
    folder that cannot be written costs the walk, not the job."""
    if d.source != "stdlib":
        return
    cache, entry = _Cache(d), _stdlib_entry(d)
    if not (cache.dir / entry).is_file():
        assert isinstance(raw.tokens, np.ndarray)  # text is read whole; only ids are sharded
        with contextlib.suppress(ConfigError):
            cache.write(entry, raw.tokens.tobytes())


def _corpus_sha256(raw: Corpus) -> str:
    return hashlib.sha256(np.ascontiguousarray(raw.tokens).data).hexdigest()


def _key(**parts: object) -> str:  # a cache entry's name: all its content depends on
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _tokenized(d: DataSection, seq_len: int, raw: Corpus) -> tuple[Corpus, Split]:
    byte_split = split_text(len(raw), d.val_fraction, seq_len)
    corpus_sha = _corpus_sha256(raw)
    if d.tokenizer == "bpe":
        json_text = _bpe_json(d, raw, byte_split, corpus_sha)
        label = f"bpe {d.vocab_size}"
    else:
        json_text = Path(d.tokenizer).read_text()
        label = f"tokenizer {d.tokenizer}"
    sha = tokenizer_sha256(json_text)
    _pin(d, sha)
    cache = _Cache(d)
    name = "tokens-" + _key(
        recipe=RECIPE,
        corpus=corpus_sha,
        tokenizer=sha,
        train=byte_split.train,
        held_out=byte_split.held_out,
    )
    found = cache.read_tokens(name)
    if found is None:
        started = time.perf_counter()
        _say(f"tokenizing {len(raw) / 1e6:.1f} MB of text ({label}; cached in {cache.dir})...")
        assert isinstance(raw.tokens, np.ndarray)  # text is read whole; only ids are sharded
        found = encode_spans(raw.tokens, byte_split, TextTokenizer(json_text).encode)
        cache.write_tokens(name, *found)
        _say(f"tokenized into {len(found[0]):,} tokens in {time.perf_counter() - started:.1f} s")
    tokens, split = found
    _check_windows(split, seq_len, byte_split)
    return Corpus(tokens=tokens, name=f"{raw.name} ({label}, sha256 {sha[:12]})"), split


def _bpe_json(d: DataSection, raw: Corpus, byte_split: Split, corpus_sha: str) -> str:
    cache = _Cache(d)
    name = "bpe-" + _key(
        recipe=RECIPE, corpus=corpus_sha, train=byte_split.train, vocab_size=d.vocab_size
    )
    found = cache.read_text(name + ".json")
    if found is not None:
        return found
    texts = [decode_text(raw.tokens[lo:hi].tobytes()) for lo, hi in byte_split.train]
    size = sum(hi - lo for lo, hi in byte_split.train)
    started = time.perf_counter()
    _say(
        f"training a {d.vocab_size}-token BPE on the {size / 1e6:.1f} MB training split "
        f"(cached in {cache.dir})..."
    )
    json_text = TextTokenizer.train(texts, d.vocab_size).json
    cache.write(name + ".json", json_text.encode())
    _say(f"trained the BPE in {time.perf_counter() - started:.1f} s")
    return json_text


def _pin(d: DataSection, sha: str) -> None:
    if d.tokenizer_sha256 and d.tokenizer_sha256 != sha:
        raise ConfigError(
            f"data.tokenizer_sha256: the job pins {d.tokenizer_sha256}, but data.tokenizer = "
            f"{d.tokenizer!r} here is {sha} (another tokenizer file, or a bpe trained on "
            "another corpus)"
        )
    d.tokenizer_sha256 = sha


def _check_windows(split: Split, seq_len: int, byte_split: Split) -> None:
    for (lo, hi), (blo, bhi) in zip(split.held_out, byte_split.held_out, strict=True):
        if hi - lo < seq_len + 1:
            raise ConfigError(
                f"data: a held-out block of {bhi - blo} bytes is {hi - lo} tokens, fewer than "
                f"a window of train.seq_len+1={seq_len + 1}; use a larger corpus "
                "(data.max_bytes), a shorter train.seq_len or data.val_fraction=0"
            )
    if all(hi - lo <= seq_len for lo, hi in split.train):
        raise ConfigError(
            f"data: no training span holds a window of train.seq_len+1={seq_len + 1} tokens; "
            "use a larger corpus (data.max_bytes) or a shorter train.seq_len"
        )


def write_atomically(path: Path, data: bytes) -> None:
    """Writes ``path`` whole or not at all: a temporary file beside it, fsynced, then
    renamed over it, so a reader never sees half a file (ranks starting together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared folder's file private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _say(message: str) -> None:
    print(f"isthmus: {message}", file=sys.stderr, flush=True)


class _Cache:
    """Files in data.cache_dir, each written whole under a temporary name, then renamed."""

    def __init__(self, d: DataSection) -> None:
        self.dir = Path(d.cache_dir) if d.cache_dir else default_cache_dir()

    def read_text(self, name: str) -> str | None:
        try:
            return (self.dir / name).read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, name: str, data: bytes) -> None:
        try:
            write_atomically(self.dir / name, data)
        except OSError as exc:
            raise ConfigError(
                f"data.cache_dir: cannot write {self.dir / name} ({exc.strerror or exc}); set "
                "data.cache_dir to a writable folder"
            ) from None

    def read_tokens(self, name: str) -> tuple[np.ndarray, Split] | None:
        # The .json is written last: with it present the .npy is whole.
        spans = self.read_text(name + ".json")
        if spans is None:
            return None
        try:  # an entry that does not read back whole is made again
            meta = json.loads(spans)
            tokens = np.load(self.dir / (name + ".npy"), mmap_mode="r")
            split = Split(
                train=tuple((lo, hi) for lo, hi in meta["train"]),
                held_out=tuple((lo, hi) for lo, hi in meta["held_out"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if tokens.dtype != np.uint16 or tokens.shape != (meta["tokens"],):
            return None
        return tokens, split

    def write_tokens(self, name: str, tokens: np.ndarray, split: Split) -> None:
        buffer = io.BytesIO()
        np.save(buffer, tokens)
        self.write(name + ".npy", buffer.getvalue())
        meta = {"tokens": len(tokens), "train": split.train, "held_out": split.held_out}
        self.write(name + ".json", json.dumps(meta).encode())
