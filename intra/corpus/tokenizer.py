"""Tokenizers for text corpora: raw bytes (the default), or a BPE vocabulary, trained here
on the training split or read from a file (a Hugging Face ``tokenizers`` tokenizer.json).

What a job needs before any process trains -- a file's vocabulary size, a tokenizer's
sha256 -- is read from the JSON alone: the CLI and the job fingerprint never import
``tokenizers``, and a run with bytes never does. Training and encoding need it (the
``isthmus[bpe]`` extra); a corpus is cut into held-out and training spans *before* it
is tokenized (``split_text``), and each span is encoded on its own (``encode_spans``),
so no held-out byte reaches the BPE trainer or a training window. The BPE trained here
is byte-level (GPT-2's pre-tokenizer and decoder, all 256 bytes in its alphabet), so
every text (``decode_text``) encodes and decodes back to itself.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..user_files import DECODE_ERRORS, decode_problem

if TYPE_CHECKING:  # numpy and batches.py load only where text is encoded
    import numpy as np

    from .batches import Split


BYTE_VOCAB = 256
MIN_BPE_VOCAB = BYTE_VOCAB + 1  # the 256 bytes and at least one merge
MAX_VOCAB = 1 << 16  # token ids are stored as uint16
VOCAB_MULTIPLE = 64
"""A tokenizer file's vocabulary is padded to a multiple of this in the model: tensor
parallel widths divide it and GPU matmuls keep their full speed (the rows above the
file's ids are never a target)."""
BYTES_PER_TOKEN_BOUND = 4
"""Bytes a token is taken to cover when a text corpus is cut before it is tokenized (a
BPE token of code or prose covers 3-4 bytes: 3.4 for the standard library at 4096
tokens); ``encode_spans``'s caller checks that each held-out block still holds a window."""
PIECE_CHARS = 1 << 16
"""Text is encoded (and trained on) in pieces of about this many characters, cut after a
newline: ``tokenizers`` encodes a batch of pieces on all cores, and the same cut in
training and encoding keeps the two consistent."""
INSTALL_HINT = "pip install 'isthmus[bpe]'"
RECIPE = f"byte-level BPE v1, pieces of {PIECE_CHARS} characters"
"""Names how ``TextTokenizer.train`` builds a tokenizer and how text is cut for it;
cache keys carry it, so a change here is a new version of the recipe."""


def require_tokenizers() -> None:
    if importlib.util.find_spec("tokenizers") is None:
        raise ValueError(f"a BPE tokenizer needs the tokenizers package: {INSTALL_HINT}")


def _tokenizers() -> Any:
    require_tokenizers()
    import tokenizers

    return tokenizers


def tokenizer_sha256(text: str | bytes) -> str:
    """sha256 of a tokenizer.json's content, whatever its spacing and key order (what the
    job fingerprint carries)."""
    canonical = json.dumps(
        json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def json_vocab_size(value: dict) -> int:
    """Token ids a parsed tokenizer.json uses: its highest id plus one (ValueError: no
    model vocabulary, or ids that do not fit uint16)."""
    model = value.get("model") if isinstance(value, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = [i for i in vocab.values() if isinstance(i, int)]
    elif isinstance(vocab, list):  # Unigram: [token, score] in id order
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise ValueError("it has no model vocabulary: not a tokenizers tokenizer.json")
    added = value.get("added_tokens") or []
    ids += [t["id"] for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]
    if not ids:
        raise ValueError("its vocabulary is empty")
    size = max(ids) + 1
    if size > MAX_VOCAB:
        raise ValueError(f"it has {size} token ids; at most {MAX_VOCAB} fit uint16")
    return size


@functools.lru_cache(maxsize=8)
def _file_facts(path: str, mtime_ns: int, size: int) -> tuple[int, str]:
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: {decode_problem(exc)}") from None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    except RecursionError:  # json's parser recurses once a level (issue 63)
        raise ValueError(f"{path} is not a tokenizer: its JSON nests too deep") from None
    try:
        vocab = json_vocab_size(value)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return vocab, tokenizer_sha256(text)


def file_facts(path: str | Path) -> tuple[int, str]:
    """A tokenizer file's token ids (highest id + 1) and sha256, read from its JSON alone
    (ValueError: no such file, not JSON, no vocabulary, or ids that do not fit uint16)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no tokenizer file {str(p)!r}")
    stat = p.stat()
    return _file_facts(str(p.resolve()), stat.st_mtime_ns, stat.st_size)


def file_vocab_size(path: str | Path) -> int:
    """The model's vocabulary for a tokenizer file: its ids, padded to ``VOCAB_MULTIPLE``."""
    size = file_facts(path)[0]
    return -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def decode_text(raw: bytes) -> str:
    """Corpus bytes as text: UTF-8, a byte that is not UTF-8 read as U+FFFD."""
    return raw.decode("utf-8", errors="replace")


def text_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``size`` characters, each after a newline where
    the window holds one; joined, they are ``text``."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            newline = text.rfind("\n", start, end)
            if newline > start:
                end = newline + 1
        pieces.append(text[start:end])
        start = end
    return pieces


class TextTokenizer:
    """A ``tokenizers`` tokenizer from its tokenizer.json: encodes text to uint16 ids.
    ValueError when ``tokenizers`` is not installed or the JSON is not a tokenizer."""

    def __init__(self, json_text: str) -> None:
        tokenizers = _tokenizers()
        try:
            value = json.loads(json_text)
        except RecursionError:  # json's parser recurses once a level (issue 63)
            raise ValueError("it is not a tokenizer: its JSON nests too deep") from None
        self.vocab_size = json_vocab_size(value)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(json_text)
        except Exception as exc:  # noqa: BLE001 - the library raises its own Exception
            raise ValueError(f"tokenizers cannot read it: {exc}") from None
        self.json = json_text
        self.sha256 = tokenizer_sha256(json_text)

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"no tokenizer file {str(p)!r}")
        try:
            return cls(p.read_text())
        except DECODE_ERRORS as exc:  # not UTF-8, not JSON, not a tokenizer, unreadable
            raise ValueError(f"{p}: {decode_problem(exc)}") from None

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int) -> TextTokenizer:
        """Train a byte-level BPE of ``vocab_size`` tokens on ``texts`` (fewer when the
        texts hold fewer pairs to merge). The same texts and size give the same
        tokenizer.json on every machine (tests/intra/test_tokenizer.py trains in two processes,
        with other hash seeds and thread counts, and compares the bytes); the job
        fingerprint carries its sha256 all the same, so a site whose ``tokenizers``
        trains otherwise is refused. ``texts``: one string per span (no piece crosses two
        spans); ``vocab_size`` counts the 256 bytes."""
        if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
            raise ValueError(
                f"vocab_size must be in {MIN_BPE_VOCAB}..{MAX_VOCAB}, got {vocab_size}"
            )
        tk = _tokenizers()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        pieces = [piece for text in texts for piece in text_pieces(text)]
        tokenizer.train_from_iterator(pieces, trainer, length=len(pieces))
        return cls(tokenizer.to_str())

    def encode(self, text: str) -> np.ndarray:
        """``text``'s token ids, uint16 (no special tokens added)."""
        return self.encode_pieces(text_pieces(text))

    def encode_pieces(self, pieces: Sequence[str]) -> np.ndarray:
        """The token ids of ``pieces``, each encoded on its own (together, on all cores),
        one after another: ``encode(text)`` is ``encode_pieces(text_pieces(text))``."""
        import numpy as np

        encodings = self._tokenizer.encode_batch_fast(list(pieces), add_special_tokens=False)
        parts = [np.asarray(e.ids, dtype=np.uint16) for e in encodings]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def split_text(n_bytes: int, fraction: float, seq_len: int) -> Split:
    """The held-out split of a text corpus, cut in bytes before it is tokenized
    (``split_corpus`` with blocks of windows at ``BYTES_PER_TOKEN_BOUND`` bytes a token)."""
    from .batches import split_corpus

    return split_corpus(n_bytes, fraction, seq_len, bytes_per_token=BYTES_PER_TOKEN_BOUND)


def encode_spans(
    raw: np.ndarray, byte_split: Split, encode: Callable[[str], np.ndarray]
) -> tuple[np.ndarray, Split]:
    """Encode a text corpus (uint8 ``raw``) span by span: the uint16 tokens, and
    ``byte_split`` in token positions.

    Every span of ``byte_split`` (which together cover ``raw``) is decoded and encoded
    on its own, in corpus order; the token spans follow from the lengths, so token span
    i holds exactly the text of byte span i and no token crosses a border.
    """
    import numpy as np

    from .batches import Split

    spans = sorted(byte_split.train + byte_split.held_out)
    assert spans and spans[0][0] == 0 and spans[-1][1] == len(raw), "spans must cover the corpus"
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), "spans must tile"
    parts, where, position = [], {}, 0
    for lo, hi in spans:
        ids = encode(decode_text(raw[lo:hi].tobytes()))
        parts.append(ids)
        where[(lo, hi)] = (position, position + len(ids))
        position += len(ids)
    tokens = np.concatenate(parts).astype(np.uint16, copy=False)
    return tokens, Split(
        train=tuple(where[s] for s in byte_split.train),
        held_out=tuple(where[s] for s in byte_split.held_out),
    )
