"""`isthmus data prepare`: text, jsonl and parquet files to token shards and a manifest;
bad input refused in one line with nothing written; a job on a folder prepared with
another tokenizer refused; documents streamed in pieces, to the tokens of the whole
document, in a memory that does not grow with the input."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ISTHMUS, assert_one_line_error, job_corpus, run_cli

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.intra.corpus import documents
from isthmus.intra.corpus.prepare import PEAK_BYTES, prepare
from isthmus.intra.corpus.tokenizer import TextTokenizer

DOCS = ["def add(a, b):\n    return a + b\n", "héllo wörld", "x = [1, 2, 3]\n" * 40]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> tuple[Path, TextTokenizer]:
    tok = TextTokenizer.train(["".join(DOCS) * 3], 300)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tok.json)
    return path, tok


def _inputs(folder: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    text = folder / "a.txt"
    text.write_text(DOCS[0])
    jsonl = folder / "b.jsonl"
    jsonl.write_text(json.dumps({"text": DOCS[1], "id": 1}) + "\n\n")  # a blank line skipped
    parquet = folder / "c.parquet"
    pq.write_table(pa.table({"text": [DOCS[2]], "id": [2]}), parquet)
    return [text, jsonl, parquet]


def test_text_jsonl_and_parquet_become_shards_and_a_manifest(tmp_path, tokenizer) -> None:
    path, tok = tokenizer
    sources = _inputs(tmp_path / "in")
    out = tmp_path / "prepared"
    manifest = prepare(sources, path, out, shard_tokens=50, progress=False)
    ids = [tok.encode(d) for d in DOCS]
    assert (
        manifest["tokens"]
        == sum(len(i) for i in ids)
        == json.loads((out / "manifest.json").read_text())["tokens"]
    )
    assert manifest["documents"] == 3 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["sha256"] == tok.sha256
    assert (out / "tokenizer.json").read_text() == tok.json
    assert [s["tokens"] for s in manifest["shards"]][:-1] == [50] * (len(manifest["shards"]) - 1)
    for src, record in zip(sources, manifest["sources"], strict=True):
        assert record["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
        assert record["bytes"] == src.stat().st_size and record["documents"] == 1
    shards = [np.fromfile(out / s["file"], dtype=np.uint16) for s in manifest["shards"]]
    assert np.array_equal(np.concatenate(shards), np.concatenate(ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "prepared"]  # no temp left


def test_an_eos_token_follows_every_document(tmp_path, tokenizer) -> None:
    path, tok = tokenizer
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    eos = tok.encode("x")[0]
    manifest = prepare(
        [tmp_path / "a.jsonl"], path, tmp_path / "out", text_field="body", eos="x", progress=False
    )
    tokens = np.fromfile(tmp_path / "out" / "shard-00000.bin", dtype=np.uint16)
    assert manifest["eos"] == {"token": "x", "id": int(eos)}
    assert np.array_equal(tokens, np.concatenate([np.append(tok.encode(d), eos) for d in DOCS]))


@pytest.mark.parametrize(
    "files, words",
    [
        ({}, "input {d}/missing.txt: no such file"),
        ({"e.txt": "", "f.jsonl": "\n\n"}, "no tokens: the 2 input file(s) hold no text"),
        ({"a.csv": "text\nhello\n"}, "unknown format '.csv'"),
        ({"a.jsonl": '{"text": "ok"}\n{oops\n'}, "line 2: not JSON"),
        ({"a.jsonl": '{"body": "ok"}\n'}, "line 1: no string field 'text'"),
    ],
    ids=["missing", "empty", "unknown-format", "not-json", "no-field"],
)
def test_bad_input_is_refused_and_nothing_is_written(tmp_path, tokenizer, files, words) -> None:
    d = tmp_path / "in"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    sources = [d / name for name in files] or [d / "missing.txt"]
    with pytest.raises(ConfigError) as caught:
        prepare(sources, tokenizer[0], tmp_path / "out", progress=False)
    assert words.format(d=d) in str(caught.value) and "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no out, no temp folder


def test_a_job_on_it_holds_out_validation_and_refuses_another_tokenizer(
    tmp_path, tokenizer
) -> None:
    path, tok = tokenizer
    (tmp_path / "a.txt").write_text("".join(DOCS) * 30)
    out = tmp_path / "prepared"
    manifest = prepare([tmp_path / "a.txt"], path, out, shard_tokens=700, progress=False)
    job = [
        "data.source=prepared",
        f"data.path={out}",
        f"data.tokenizer={out / 'tokenizer.json'}",
        "train.seq_len=16",
    ]
    config = load_config(None, job)
    corpus, split = job_corpus(config)
    assert len(corpus) == manifest["tokens"] and split.held_out
    assert config.data.tokenizer_sha256 == tok.sha256  # pinned: part of the fingerprint
    other = tmp_path / "other.json"
    other.write_text(TextTokenizer.train(["abc abd " * 20], 260).json)
    with pytest.raises(ConfigError, match=r"was prepared with tokenizer sha256 .* use the"):
        job_corpus(load_config(None, [*job[:2], f"data.tokenizer={other}", job[3]]))
    with pytest.raises(ConfigError, match="needs data.tokenizer = the tokenizer.json"):
        load_config(None, job[:2])


def test_the_cli_refuses_in_one_line(tmp_path, tokenizer) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "a.txt").write_text("hello")
    args = ("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer[0]))
    assert_one_line_error(
        run_cli(*args, "--out", str(tmp_path / "out"), timeout=60), "exists; pass --force"
    )
    done = run_cli(*args, "--out", str(tmp_path / "new"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "data.source=prepared" in done.stdout and "100%" in done.stderr


def _tricky_text(rng: random.Random, chars: int) -> str:
    """Text that cuts badly: stretches without a newline longer than a piece (65,536
    characters), one- to four-byte characters, CRLF, quotes and backslashes for JSON."""
    alphabet = ["a", "b", " ", "\n", "\r\n", "\t", "é", "日", "😀", '"', "\\", "\u2028", "x = [1]"]
    runs = []
    while sum(map(len, runs)) < chars:
        runs.append("".join(rng.choices(alphabet, k=rng.choice([10, 1000, 40_000]))))
        runs.append("".join(rng.choices(alphabet[:3] + alphabet[6:], k=70_000)))  # no newline
    return "".join(runs)[:chars]


def test_streamed_documents_are_the_tokens_of_whole_ones(tmp_path, tokenizer, monkeypatch) -> None:
    """Read in odd small blocks, the long jsonl lines over LINE_BYTES (so streamed, their
    text decoded in segments), encoded a few pieces at a time: the tokens are those of
    encoding each whole document, and of a prepare with the defaults (which parses every
    line here whole)."""
    path, tok = tokenizer
    rng = random.Random(63)
    texts = [_tricky_text(rng, 150_000), _tricky_text(rng, 90_000) + "\ud800 lone"]
    raw = texts[0].encode() + b"\xff bad \xe0\x80 bytes" + texts[1][:5_000].encode()[:-1]
    (tmp_path / "a.txt").write_bytes(raw)
    lines = [
        # ensure_ascii: every non-ASCII character an escape, 😀 a surrogate pair.
        '{"id": 1, "meta": {"text": "nested"}, "te\\u0078t": ' + json.dumps(texts[0]) + "}",
        "",
        json.dumps({"n": [1, 2.5, None, True], "text": texts[1], "z": "x" * 5000}),
        json.dumps({"text": texts[1][:20_000], "other": texts[0][:9_000]}, ensure_ascii=False),
        json.dumps({"text": ""}),  # no text: not a document
        json.dumps({"text": "short"}),
    ]
    (tmp_path / "b.jsonl").write_text("\n".join(lines))  # the last line without a newline
    in_jsonl = [texts[0], texts[1].replace("\ud800", "\ufffd"), texts[1][:20_000], "short"]
    eos = int(tok.encode("x")[0])
    expected = np.concatenate(
        [np.append(tok.encode(t), eos) for t in [raw.decode("utf-8", "replace"), *in_jsonl]]
    )
    sources = [tmp_path / "a.txt", tmp_path / "b.jsonl"]
    whole = prepare(sources, path, tmp_path / "whole", eos="x", progress=False)
    monkeypatch.setattr(documents, "READ_BYTES", 1021)
    monkeypatch.setattr(documents, "LINE_BYTES", 4000)
    streamed = prepare(sources, path, tmp_path / "out", eos="x", progress=False, batch_bytes=3000)
    for out, manifest in [(tmp_path / "whole", whole), (tmp_path / "out", streamed)]:
        tokens = np.fromfile(out / "shard-00000.bin", dtype=np.uint16)
        assert np.array_equal(tokens, expected)
        assert [s["documents"] for s in manifest["sources"]] == [1, 4]
        for src, record in zip(sources, manifest["sources"], strict=True):
            assert record["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


LONG = "x" * 5_000


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"text": "' + LONG, "not JSON"),  # the file ends inside the string
        ('{"text": "' + LONG + '\n"}', "not JSON"),  # a newline inside a string
        ('{"text": "' + LONG + '\\q"}', "not JSON"),  # no such escape
        ('{"text": "' + LONG + '\x01"}', "not JSON"),  # a control character
        ('{"text": "' + LONG + '", "n": 1.}', "not JSON"),
        ('{"text": "' + LONG + '"} {}', "not JSON"),
        ('{"body": "' + LONG + '"}', "line 1: no string field 'text'"),
        ('{"text": 5, "body": "' + LONG + '"}', "line 1: no string field 'text'"),
        ('{"text": "a", "text": null, "body": "' + LONG + '"}', "no string field 'text'"),
        ('["text", "' + LONG + '"]', "line 1: no string field 'text'"),
        ('{"meta": {"text": "' + LONG + '"}}', "line 1: no string field 'text'"),
    ],
    ids=[
        "unterminated",
        "newline-in-string",
        "bad-escape",
        "control-character",
        "bad-number",
        "two-values",
        "no-field",
        "not-a-string",
        "last-one-counts",
        "an-array",
        "nested-field",
    ],
)
def test_a_long_line_is_refused_as_a_short_one_is(tmp_path, tokenizer, monkeypatch, line, words):
    (tmp_path / "a.jsonl").write_bytes(line.encode())
    errors = []
    for line_bytes in (documents.LINE_BYTES, 1000):  # parsed whole, then streamed
        monkeypatch.setattr(documents, "LINE_BYTES", line_bytes)
        with pytest.raises(ConfigError) as caught:
            prepare([tmp_path / "a.jsonl"], tokenizer[0], tmp_path / "out", progress=False)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and words in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_a_long_line_holds_its_text_once_and_little_else(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(documents, "LINE_BYTES", 1000)
    for name, record, words in [
        ("twice", {"text": LONG, "t": "b"}, "line 1: the field 'text' twice in a long line"),
        ("numbers", {"text": "a", "n": list(range(1000))}, "line 1: over .* MiB of JSON outside"),
    ]:
        line = json.dumps(record).replace('"t":', '"text":')
        (tmp_path / f"{name}.jsonl").write_text(line + '\n{"text": "b"}\n')
        with pytest.raises(ConfigError, match=words):
            prepare([tmp_path / f"{name}.jsonl"], tokenizer[0], tmp_path / "out", progress=False)


# Runs a command and prints its exit code and peak RSS (KiB). The command's peak is read
# here, in a small process that starts it, not in pytest: Linux counts in a child's
# ru_maxrss the memory of the process it was forked from (the high-water mark before
# exec), which for the test's own child would be pytest's.
MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _peak_rss(*args: str | Path) -> int:
    """The peak RSS, in bytes, of `isthmus data prepare ARGS` run to success."""
    cmd = [*ISTHMUS, "data", "prepare", *map(str, args), "--force", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, timeout=100
    )
    code, kib = map(int, done.stdout.split())
    assert code == 0, done.stderr
    return kib * 1024


@pytest.mark.timeout(120)
def test_memory_does_not_grow_with_the_input(tmp_path, tokenizer) -> None:
    """An 8 MB text file and an 8 MB one-line jsonl stay under PEAK_BYTES above the same
    command on a 5-byte file, run just before (the interpreter, numpy, tokenizers and the
    tokenizer: ~60 MB). Whole, either took ~600 MB more (at ~75 bytes a byte); streamed
    ~95 MB (2026-12-07, 2-core VM)."""
    path = tokenizer[0]
    text = ("a" * 4000 + " é\n") * 2000  # cheap to tokenize: a token a byte, few words
    (tmp_path / "tiny.txt").write_text("hello")
    (tmp_path / "big.txt").write_text(text)
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": text}) + "\n")  # é escaped
    out = ("--tokenizer", path, "--out", tmp_path / "out")
    baseline = _peak_rss(tmp_path / "tiny.txt", *out)
    for big in ("big.txt", "big.jsonl"):
        above = _peak_rss(tmp_path / big, *out) - baseline
        assert above < PEAK_BYTES, f"{big}: {above / 2**20:.0f} MiB above the interpreter"
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == 1 and manifest["sources"][0]["bytes"] > 8_000_000
