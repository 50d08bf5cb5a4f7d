"""How `isthmus data prepare` reads its inputs: each document as a stream of text chunks.

No document is held whole, so a prepare's memory does not grow with its input
(docs/data.md, "Memory"). A ``.txt`` file is read ``READ_BYTES`` at a time and decoded
incrementally (a UTF-8 character cut by a block is carried to the next, so the text is
exactly ``bytes.decode("utf-8", errors="replace")`` of the whole file). A ``.jsonl`` line
of at most ``LINE_BYTES`` is parsed by ``json.loads`` as it always was; a longer one is
read as a stream (``_long_line``): its top-level ``--text-field`` string is decoded a
segment at a time, its other strings are checked and dropped, and what is left (its
structure, numbers and keys, every string written ``""``) must fit ``LINE_BYTES`` and is
handed to ``json.loads`` to check the line and its field. The text is the same either
way. A ``.parquet`` row comes from ``datasets`` whole, as one string.

Every file's bytes are hashed and counted on the progress bar as they are read.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..user_files import ConfigError

__all__ = ["DATASETS_HINT", "FORMATS", "LINE_BYTES", "READ_BYTES", "documents"]

FORMATS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
"""File suffix -> how its documents are read."""
DATASETS_HINT = "pip install 'isthmus[data]'"
READ_BYTES = 1 << 20
"""A file is read this many bytes at a time."""
LINE_BYTES = 1 << 20
"""A jsonl line up to this long is parsed whole; a longer one is streamed, and what it
holds outside its strings (each string counted as 2 bytes) must fit this."""

_OUTSIDE = re.compile(rb'[^"\n]*')
"""JSON outside strings: up to the next string or the end of the line."""
_CONTENT = re.compile(rb'[^"\\\n]*(?:\\[^\n][^"\\\n]*)*')
"""A string's content up to its closing quote: plain bytes and two-byte escapes."""
_UNSAFE_END = re.compile(
    # A segment must not end inside a UTF-8 character, inside an escape, or between the
    # two \u escapes of a surrogate pair: such a tail waits for the next segment. The
    # lookbehind and the escaped backslashes keep the count of backslashes even, so "\\"
    # is never read as the start of an escape.
    rb"(?:(?<!\\)(?:\\\\)*(?:\\u[dD][89abAB][0-9a-fA-F]{2})?(?:\\(?:u[0-9a-fA-F]{0,3})?)?"
    rb"|[\xc0-\xff][\x80-\xbf]{0,2})\Z"
)
_COLON = re.compile(rb"[ \t\r]*:[ \t\r]*")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_BOM = codecs.BOM_UTF8


def documents(
    src: Path,
    text_field: str,
    digest: hashlib._Hash,
    advance: Callable[[int], None],
    hf_cache: Path,
) -> Iterator[Iterable[str]]:
    """``src``'s documents in order, each as its text in chunks (of a text file or a long
    jsonl line: about ``READ_BYTES`` characters at most), each consumed before the next is
    asked for. ConfigError names the file (and line) of an unreadable file or bad record."""
    kind = FORMATS[src.suffix.lower()]
    if kind == "parquet":
        yield from ((text,) for text in _parquet(src, text_field, hf_cache))
        return
    try:
        with open(src, "rb") as f:
            reader = _Reader(f, digest, advance)
            if kind == "text":
                yield _guarded(src, _text(reader))
            else:
                yield from _jsonl(src, reader, text_field)
    except OSError as exc:
        raise ConfigError(f"input {src}: {exc.strerror or exc}") from None


def _guarded(src: Path, chunks: Iterator[str]) -> Iterator[str]:
    """``chunks``, a read error named with the file (a document is read by its caller)."""
    try:
        yield from chunks
    except OSError as exc:
        raise ConfigError(f"input {src}: {exc.strerror or exc}") from None


class _Reader:
    """A file's bytes, ``READ_BYTES`` at a time, hashed and counted on the bar as read."""

    def __init__(self, f: BinaryIO, digest: hashlib._Hash, advance: Callable[[int], None]) -> None:
        self.f, self.digest, self.advance = f, digest, advance
        self.buf = b""
        self.pos = 0

    def fill(self) -> bool:
        """Read the next block after what is unconsumed; False at the end."""
        block = self.f.read(READ_BYTES)
        self.digest.update(block)
        self.advance(len(block))
        if not block:
            return False
        self.buf = self.buf[self.pos :] + block
        self.pos = 0
        return True

    def take(self, end: int) -> bytes:
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def line(self, limit: int) -> bytes | None:
        """The next line, newline included, of at most ``limit`` bytes (b"" at the end);
        None, consuming nothing, for a longer one."""
        searched = self.pos
        while True:
            newline = self.buf.find(b"\n", searched)
            if newline >= 0:
                return self.take(newline + 1) if newline + 1 - self.pos <= limit else None
            if len(self.buf) - self.pos > limit:
                return None
            searched = len(self.buf) - self.pos
            if not self.fill():
                return self.take(len(self.buf))


def _text(reader: _Reader) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while reader.fill():
        yield decoder.decode(reader.take(len(reader.buf)))
    yield decoder.decode(b"", final=True)


def _jsonl(src: Path, reader: _Reader, text_field: str) -> Iterator[Iterable[str]]:
    number = 0
    while (line := reader.line(LINE_BYTES)) != b"":
        number += 1
        if line is None:
            document = _guarded(src, _long_line(reader, text_field, f"input {src}, line {number}"))
            yield document
            for _ in document:  # the caller reads it all; this keeps the file's place if not
                pass
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"input {src}, line {number}: not JSON") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(_no_field(f"input {src}, line {number}", text_field))
        yield (_no_lone_surrogates(text),)


def _no_field(where: str, text_field: str) -> str:
    return f"{where}: no string field {text_field!r} (--text-field names it)"


def _no_lone_surrogates(text: str) -> str:
    # A "\ud800" escape without its pair decodes to a lone surrogate, which is no UTF-8
    # text (tokenizers refuses it): it is read as U+FFFD, as a byte that is not UTF-8 is.
    return text if text.isascii() else _LONE_SURROGATE.sub("\ufffd", text)


def _long_line(reader: _Reader, text_field: str, where: str) -> Iterator[str]:
    """The text of a jsonl line longer than ``LINE_BYTES``, read as a stream (the module
    docstring); the line, its newline included, is consumed."""
    skeleton = bytearray()
    depth = 0
    after_field = False  # the last string was text_field, at the record's top level
    values = 0  # text_field's string values seen
    if reader.buf.startswith(_BOM, reader.pos):  # json.loads of bytes skips it too
        reader.take(reader.pos + len(_BOM))
    while True:
        start = len(skeleton)
        stop = _outside(reader, skeleton)
        if len(skeleton) > LINE_BYTES:
            raise ConfigError(
                f"{where}: over {LINE_BYTES / 2**20:g} MiB of JSON outside its strings; a "
                "line longer than that is read as a stream, which holds only its strings' bytes"
            )
        run = bytes(skeleton[start:])
        depth += run.count(b"{") + run.count(b"[") - run.count(b"}") - run.count(b"]")
        if stop != b'"':
            break
        if after_field and _COLON.fullmatch(run):
            values += 1
            if values > 1:
                raise ConfigError(f"{where}: the field {text_field!r} twice in a long line")
            for segment in _segments(reader, where):
                yield _no_lone_surrogates(segment)
            skeleton += b'""'
            after_field = False
            continue
        # Every other string is checked and written as "", but for one at the top level
        # that may be text_field's key.
        key = _string(reader, where, len(text_field) if depth == 1 else -1)
        after_field = key == text_field
        skeleton += b'"t"' if after_field else b'""'
    if not skeleton.strip() and not values:
        return  # a blank line
    try:
        record = json.loads(skeleton)
    except ValueError:
        raise ConfigError(f"{where}: not JSON") from None
    if not isinstance(record, dict) or not isinstance(record.get("t"), str):
        raise ConfigError(_no_field(where, text_field))


def _outside(reader: _Reader, skeleton: bytearray) -> bytes:
    """Copy JSON outside strings into ``skeleton`` up to a string's opening quote (consumed:
    returns b'"'), the line's newline (consumed: b"\\n") or the end of the file (b"")."""
    while True:
        match = _OUTSIDE.match(reader.buf, reader.pos)
        assert match is not None  # the pattern matches the empty string
        skeleton += reader.take(match.end())
        if reader.pos < len(reader.buf):
            return reader.take(reader.pos + 1)
        if len(skeleton) > LINE_BYTES or not reader.fill():
            return b""


def _string(reader: _Reader, where: str, keep: int) -> str | None:
    """A string's text (read after its opening quote, every segment checked), or None
    when it is longer than ``keep`` characters."""
    parts, size = [], 0
    for segment in _segments(reader, where):
        size += len(segment)
        if size <= keep:
            parts.append(segment)
    return "".join(parts) if size <= keep else None


def _segments(reader: _Reader, where: str) -> Iterator[str]:
    """A string's text, decoded a segment at a time (after its opening quote; the closing
    one is consumed). json.loads decodes each segment: the same text, checks and errors
    as for the whole line, since no segment ends inside an escape, a surrogate pair or a
    UTF-8 character."""
    while True:
        match = _CONTENT.match(reader.buf, reader.pos)
        assert match is not None  # the pattern matches the empty string
        end = match.end()
        if end < len(reader.buf):
            if reader.buf[end] == ord('"'):
                yield _decode(reader.take(end), where)
                reader.take(end + 1)
                return
            if reader.buf[end] != ord("\\") or end + 1 < len(reader.buf):
                raise ConfigError(f"{where}: not JSON")  # the line ends inside the string
        # The block ended inside the string (perhaps just after a backslash): decode up to
        # a safe end, and read on. The tail looked at starts where no escape is cut: an
        # even number of bytes into a run of backslashes (reader.pos is never inside an
        # escape), or where no backslash precedes.
        tail = max(reader.pos, end - 64)
        head = reader.buf[reader.pos : tail]
        run = tail - (len(head) - len(head.rstrip(b"\\")))
        tail = min(end, run + (tail - run + 1) // 2 * 2)
        unsafe = _UNSAFE_END.search(reader.buf[tail:end])
        cut = tail + unsafe.start() if unsafe else end
        if cut > reader.pos:
            yield _decode(reader.take(cut), where)
        if not reader.fill():
            raise ConfigError(f"{where}: not JSON")


def _decode(content: bytes, where: str) -> str:
    try:  # as json.loads decodes a line's bytes: UTF-8, surrogates let through
        return json.loads('"' + content.decode("utf-8", "surrogatepass") + '"')
    except ValueError:  # also a UnicodeDecodeError
        raise ConfigError(f"{where}: not JSON") from None


def _parquet(src: Path, text_field: str, hf_cache: Path) -> Iterator[str]:
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only: never the hub
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"input {src}: parquet needs the datasets package: {DATASETS_HINT}"
        ) from None
    datasets.disable_progress_bars()  # ours is on stderr already
    try:
        rows = datasets.load_dataset(
            # The lock files datasets keeps go in the folder being written, not ~/.cache.
            "parquet",
            data_files=[str(src)],
            split="train",
            streaming=True,
            cache_dir=str(hf_cache),
        )
        if text_field not in (rows.column_names or [text_field]):
            raise ConfigError(
                f"input {src}: no column {text_field!r} (it has {rows.column_names}; "
                "--text-field names it)"
            )
        for number, row in enumerate(rows):
            text = row.get(text_field)
            if not isinstance(text, str):
                raise ConfigError(f"input {src}, row {number}: {text_field!r} is not a string")
            if text:
                yield text
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow and datasets raise many kinds
        raise ConfigError(f"input {src}: cannot read it as parquet ({exc})") from None
