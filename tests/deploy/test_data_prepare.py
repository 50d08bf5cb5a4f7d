"""`isthmus data prepare`: text, jsonl and parquet files to token shards and a manifest;
bad input refused in one line with nothing written; a job on a folder prepared with
another tokenizer refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_line_error, run_cli

from isthmus.deploy.commands.data import prepare
from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.rank.corpus import load_corpus
from isthmus.intra.tokenizer import TextTokenizer

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
    corpus, split = load_corpus(config)
    assert len(corpus) == manifest["tokens"] and split.held_out
    assert config.data.tokenizer_sha256 == tok.sha256  # pinned: part of the fingerprint
    other = tmp_path / "other.json"
    other.write_text(TextTokenizer.train(["abc abd " * 20], 260).json)
    with pytest.raises(ConfigError, match=r"was prepared with tokenizer sha256 .* use the"):
        load_corpus(load_config(None, [*job[:2], f"data.tokenizer={other}", job[3]]))
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
