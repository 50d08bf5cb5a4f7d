"""Tokenizers: a BPE trained on the training split (never on held-out text), or a
tokenizer.json given; the split cut on the text first; the cache; the job fingerprint;
a real two-site job; settings refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_one_line_error, job_corpus, run_cli, start_coordinator

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.inter.control.fingerprint import fingerprint_problem
from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.corpus.cache import pin_tokenizer
from isthmus.intra.corpus.tokenizer import (
    TextTokenizer,
    decode_text,
    file_vocab_size,
    split_text,
    text_pieces,
    tokenizer_sha256,
)
from isthmus.intra.corpus.tokens import stdlib_corpus

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.timeout(120)

SEQ = 64
MARKER = "zyzzyva quokka "
"""Text that only the held-out blocks of the marked corpus hold."""


def settings(cache: Path, *extra: str) -> list[str]:
    return [f"data.cache_dir={cache}", f"train.seq_len={SEQ}", "model.preset=tiny", *extra]


@pytest.fixture(scope="module")
def stdlib_text() -> bytes:
    return stdlib_corpus(200_000).tokens.tobytes()


@pytest.fixture
def marked(tmp_path: Path, stdlib_text: bytes) -> Path:
    """A text file whose held-out blocks (val_fraction 0.5: every other block) hold
    nothing but MARKER, which its training blocks never hold."""
    raw = bytearray(stdlib_text)
    assert MARKER.split()[0].encode() not in raw
    for lo, hi in split_text(len(raw), 0.5, SEQ).held_out:
        raw[lo:hi] = (MARKER * (hi - lo))[: hi - lo].encode()
    path = tmp_path / "marked.txt"
    path.write_bytes(bytes(raw))
    return path


def test_training_is_deterministic_across_processes(tmp_path, stdlib_text):
    """Same text and size: the same tokenizer.json, byte for byte, whatever the hash
    seed and the number of threads."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(stdlib_text)
    code = (
        "import sys; from pathlib import Path; from isthmus.intra.corpus.tokenizer import "
        "TextTokenizer, decode_text; text = decode_text(Path(sys.argv[1]).read_bytes()); "
        "Path(sys.argv[2]).write_text(TextTokenizer.train([text[:90000], text[90000:]], 700).json)"
    )
    outputs = []
    for run, env in enumerate(
        ({"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "2", "RAYON_NUM_THREADS": "1"})
    ):
        out = tmp_path / f"tok{run}.json"
        subprocess.run(
            [sys.executable, "-c", code, str(corpus), str(out)],
            env={**os.environ, **env},
            check=True,
            timeout=60,
        )
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    here = TextTokenizer.train([stdlib_text.decode()[:90000], stdlib_text.decode()[90000:]], 700)
    assert here.json.encode() == outputs[0]
    assert here.vocab_size == 700


def test_round_trip_and_pieces(stdlib_text):
    text = decode_text(stdlib_text)
    tokenizer = TextTokenizer.train([text], 512)
    ids = tokenizer.encode(text)
    assert ids.dtype == np.uint16 and int(ids.max()) < 512
    assert len(ids) < len(stdlib_text) / 2  # it compresses: ~2.3 bytes a token at 512
    assert tokenizer.decode(ids) == text
    odd = "naïve café — 東京\n\tx = 'ünïcode'  \r\n" * 3
    assert tokenizer.decode(tokenizer.encode(odd)) == odd
    # Bytes that are not UTF-8 become U+FFFD; the rest is kept.
    assert decode_text(b"ok \xff\xfe end") == "ok \ufffd\ufffd end"
    pieces = text_pieces(text, 1000)
    assert "".join(pieces) == text and all(len(p) <= 1000 for p in pieces)
    assert all(p.endswith("\n") for p in pieces[:-1])  # this text has a newline in every window


def test_no_held_out_byte_reaches_the_trainer_or_a_training_window(tmp_path, marked, monkeypatch):
    seen: list[str] = []
    real_train = TextTokenizer.train

    def spy(texts, vocab_size):
        seen.extend(texts)
        return real_train(texts, vocab_size)

    monkeypatch.setattr(TextTokenizer, "train", staticmethod(spy))
    job = settings(
        tmp_path / "cache",
        "data.source=path",
        f"data.path={marked}",
        "data.tokenizer=bpe",
        "data.vocab_size=512",
        "data.val_fraction=0.5",
    )
    config = load_config(None, job)
    corpus, split = job_corpus(config)
    raw = marked.read_bytes()
    byte_split = split_text(len(raw), 0.5, SEQ)
    # The trainer saw exactly the training spans' text, and no marker.
    assert seen == [decode_text(raw[lo:hi]) for lo, hi in byte_split.train]
    assert not any("zyzz" in text for text in seen)
    tokenizer = TextTokenizer(config_json(tmp_path / "cache"))
    assert tokenizer.sha256 == config.data.tokenizer_sha256
    assert not [t for t in json.loads(tokenizer.json)["model"]["vocab"] if "zyzz" in t]
    # The held-out spans are the marker; no training window reads any of it.
    for (lo, hi), (blo, bhi) in zip(split.held_out, byte_split.held_out, strict=True):
        text = tokenizer.decode(corpus.tokens[lo:hi])
        assert text == (MARKER * (bhi - blo))[: bhi - blo]
    batches = ShardedBatches(corpus, seq_len=SEQ, batch_size=8, seed=0, spans=split.train)
    for step in range(40):
        for start in batches.window_starts(step):
            assert any(lo <= start and start + SEQ + 1 <= hi for lo, hi in split.train)
            assert "zyzz" not in tokenizer.decode(corpus.tokens[start : start + SEQ + 1])
    # The control: trained on everything, the marker is in the vocabulary.
    seen.clear()
    everything = load_config(None, [*job[:-1], "data.val_fraction=0"])
    job_corpus(everything)
    assert any("zyzz" in text for text in seen)
    vocab = json.loads(config_json(tmp_path / "cache", everything.data.tokenizer_sha256))
    assert [t for t in vocab["model"]["vocab"] if "zyzz" in t]


def config_json(cache: Path, sha: str | None = None) -> str:
    """The (one, or the one with ``sha``) trained BPE in a cache folder."""
    found = [p.read_text() for p in sorted(cache.glob("bpe-*.json"))]
    if sha is not None:
        found = [text for text in found if tokenizer_sha256(text) == sha]
    assert len(found) == 1, sorted(cache.iterdir())
    return found[0]


def test_token_split_matches_the_byte_split_and_the_cache_is_reused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    job = settings(cache, "data.tokenizer=bpe", "data.vocab_size=600", "data.max_bytes=300000")
    config = load_config(None, job)
    corpus, split = job_corpus(config)
    raw = stdlib_corpus(300_000).tokens.tobytes()
    byte_split = split_text(len(raw), 0.01, SEQ)
    assert len(split.held_out) == len(byte_split.held_out) == 6
    assert len(split.train) == len(byte_split.train)
    spans = sorted(split.train + split.held_out)
    assert spans[0][0] == 0 and spans[-1][1] == len(corpus)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # they tile
    tokenizer = TextTokenizer(config_json(cache))
    for tokens, raw_span in zip(
        split.train + split.held_out, byte_split.train + byte_split.held_out, strict=True
    ):
        text = tokenizer.decode(corpus.tokens[tokens[0] : tokens[1]])
        assert text == decode_text(raw[raw_span[0] : raw_span[1]])
        assert tokens[1] - tokens[0] > SEQ  # every held-out block holds a window
    assert config.resolved_model().vocab_size == 600
    # Again: from the cache, neither trained nor encoded, the same tokens; no temp files.
    monkeypatch.setattr(TextTokenizer, "train", None)
    monkeypatch.setattr(TextTokenizer, "encode", None)
    again, split_again = job_corpus(load_config(None, job))
    assert split_again == split and np.array_equal(again.tokens, corpus.tokens)
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


def test_byte_runs_and_cache_hits_never_import_tokenizers(tmp_path):
    """The GPU machines do not have it: a byte job never imports it, nor does a rank
    that finds the trained BPE and the encoded corpus in the cache."""
    cache = tmp_path / "cache"
    job = settings(cache, "data.tokenizer=bpe", "data.vocab_size=300", "data.max_bytes=200000")
    job_corpus(load_config(None, job))
    code = (
        "import sys; from isthmus.deploy.config.job import load_config; "
        "from isthmus.intra.corpus.cache import load_corpus; "
        "c = load_config(None, sys.argv[1:]); load_corpus(c.data, seq_len=c.train.seq_len, "
        "vocab=c.resolved_model().vocab_size); print('tokenizers' in sys.modules)"
    )
    for args in ([], job):
        result = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert result.stdout.strip() == "False", result.stderr


def two_tokenizers(tmp_path: Path, stdlib_text: bytes) -> tuple[Path, Path]:
    """Two tokenizer files of one vocabulary size (so the model's shape agrees) and
    different merges."""
    text = decode_text(stdlib_text)
    paths = []
    for name, part in (("a", text[:60000]), ("b", text[60000:120000])):
        path = tmp_path / f"{name}.json"
        path.write_text(TextTokenizer.train([part], 300).json)
        paths.append(path)
    return paths[0], paths[1]


def test_the_tokenizer_is_part_of_the_fingerprint(tmp_path, stdlib_text):
    a, b = two_tokenizers(tmp_path, stdlib_text)
    moved = tmp_path / "elsewhere" / "a.json"
    moved.parent.mkdir()
    moved.write_text(json.dumps(json.loads(a.read_text()), indent=2))  # same content, spaced
    prints = {}
    for name, path in (("a", a), ("b", b), ("moved", moved)):
        config = load_config(None, [f"data.tokenizer={path}", "model.preset=tiny"])
        assert config.resolved_model().vocab_size == file_vocab_size(path) == 320  # 300 -> x64
        pin_tokenizer(config.data, seq_len=config.train.seq_len)
        prints[name] = config.fingerprint()
    assert prints["a"]["data.tokenizer"] == "file"
    assert prints["a"] == prints["moved"]  # where a site keeps the file does not matter
    problem = fingerprint_problem(prints["a"], prints["b"], "site0", "site1")
    assert problem is not None and "data.tokenizer_sha256" in problem
    assert problem.count("=") == 1  # the tokenizer alone differs: the model agrees
    # A byte job and a bpe job differ in the tokenizer and the model's vocabulary.
    plain = load_config(None, ["model.preset=tiny"]).fingerprint()
    assert plain["data.tokenizer"] == "bytes" and plain["model.vocab_size"] == "256"
    assert "data.vocab_size" not in plain and "data.cache_dir" not in plain
    bpe = load_config(None, ["model.preset=tiny", "data.tokenizer=bpe"]).fingerprint()
    assert bpe["data.vocab_size"] == bpe["model.vocab_size"] == "4096"
    # A pinned hash that is not the tokenizer's is refused.
    pinned = load_config(None, [f"data.tokenizer={b}", f"data.tokenizer_sha256={'0' * 64}"])
    with pytest.raises(ConfigError, match="data.tokenizer_sha256: the job pins 0000"):
        pin_tokenizer(pinned.data, seq_len=pinned.train.seq_len)


def test_a_site_with_another_tokenizer_file_is_refused_at_join(tmp_path, stdlib_text):
    """Two `isthmus coordinator` processes whose tokenizer files differ."""
    a, b = two_tokenizers(tmp_path, stdlib_text)
    first, address = start_coordinator(
        *("--site", "site0", "--peer", "site1=127.0.0.1:1", "--set", f"data.tokenizer={a}")
    )
    try:
        started = time.monotonic()
        second = run_cli(
            *("coordinator", "--site", "site1", "--peer", f"site0={address}"),
            *("--set", f"data.tokenizer={b}"),
            timeout=60,
        )
        assert time.monotonic() - started < 30
        assert_one_line_error(second, "fingerprint differs", "data.tokenizer_sha256")
    finally:
        first.terminate()
        _, log = first.communicate(timeout=10)
    # The refusing site logs both hashes; both hold the user's job token
    # (deploy/security/token.py), so the refused one is one of the job's and told them too.
    a_sha, b_sha = (tokenizer_sha256(p.read_text()) for p in (a, b))
    assert f"data.tokenizer_sha256={a_sha} vs {b_sha}" in log
    assert f"data.tokenizer_sha256={a_sha} vs {b_sha}" in second.stderr


def test_the_tokenizer_command_writes_what_a_bpe_job_trains(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "tok.json"
    common = [arg for s in settings(cache, "data.max_bytes=200000") for arg in ("--set", s)]
    result = run_cli("tokenizer", "--out", str(out), "--vocab-size", "400", *common, timeout=60)
    assert result.returncode == 0, result.stderr
    sha = tokenizer_sha256(out.read_text())
    assert f"sha256 {sha}" in result.stdout and f"data.tokenizer={out}" in result.stdout
    # A job with data.tokenizer = bpe trains the same one (here: finds it in the cache).
    job = load_config(
        None, settings(cache, "data.max_bytes=200000", "data.tokenizer=bpe", "data.vocab_size=400")
    )
    pin_tokenizer(job.data, seq_len=job.train.seq_len)
    assert job.data.tokenizer_sha256 == sha
    assert load_config(None, [f"data.tokenizer={out}"]).resolved_model().vocab_size == 448
    again = run_cli("tokenizer", "--out", str(out), *common, timeout=60)
    assert_one_line_error(again, f"--out {out} exists; pass --force")


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("data.tokenizer=gpt2", 'data.tokenizer must be "bytes", "bpe" or the path'),
        ("data.tokenizer=/no/such/tokenizer.json", "'/no/such/tokenizer.json' is neither"),
        ("data.tokenizer=bpe data.vocab_size=256", "data.vocab_size must be in 257..65536"),
        ("data.tokenizer=bpe data.vocab_size=65537", "data.vocab_size must be in 257..65536"),
        ("data.tokenizer=bpe data.source=path data.path=BIN", "holds token ids already"),
        ("data.tokenizer=NOTJSON", "is not JSON"),
        ("data.tokenizer_sha256=abc", "data.tokenizer_sha256 must be empty or 64"),
        ("data.tokenizer_sha256=" + "0" * 64, 'data.tokenizer = "bytes" has none'),
        (
            "data.tokenizer=GOOD data.tokenizer_sha256=" + "0" * 64,
            "data.tokenizer_sha256: the job pins",
        ),
    ],
)
def test_bad_tokenizer_settings_are_one_line_errors(tmp_path, setting, needle):
    (tmp_path / "tokens.bin").write_bytes(bytes(4096))
    (tmp_path / "bad.json").write_text("{not json")
    good = tmp_path / "good.json"
    good.write_text(TextTokenizer.train(["def f(x):\n    return x\n" * 50], 300).json)
    setting = setting.replace("BIN", str(tmp_path / "tokens.bin"))
    setting = setting.replace("NOTJSON", str(tmp_path / "bad.json")).replace("GOOD", str(good))
    args = [arg for one in setting.split() for arg in ("--set", one)]
    args += ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--run-dir", str(tmp_path / "run")]
    result = run_cli("local", *args, "--set", "model.preset=tiny", timeout=60)
    assert_one_line_error(result, needle)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_without_tokenizers_a_bpe_setting_says_how_to_install_it():
    code = (
        "import sys; sys.modules['tokenizers'] = None; from isthmus.deploy.cli import main; "
        "sys.exit(main(['config', '--set', 'data.tokenizer=bpe']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert_one_line_error(result, "data.tokenizer = 'bpe'", "pip install 'isthmus[bpe]'")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_site_job_with_a_bpe_trained_here(tmp_path):
    """`isthmus local` trains the BPE once (the launcher), its ranks find it in the
    cache; the sites end identical, with a held-out loss, and the run's config pins the
    tokenizer."""
    run = tmp_path / "run"
    job = settings(tmp_path / "cache", "data.tokenizer=bpe", "data.vocab_size=512")
    job += ["data.max_bytes=300000", "run.eval_batches=2"]
    args = [arg for s in job for arg in ("--set", s)]
    result = run_cli(
        "local", *args, "--ranks-per-site", "1", "--steps", "4", "--run-dir", str(run), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("training a 512-token BPE") == 1  # the launcher, not the ranks
    summary = json.loads((run / "summary.json").read_text())
    assert len(set(summary["digests"].values())) == 1
    assert summary["val_loss"] > 0
    # A loss per token of a 512-token vocabulary starts near ln(512), not ln(256).
    assert summary["loss_first"] == pytest.approx(np.log(512), abs=0.5)
    resolved = load_config(run / "config.toml")
    assert resolved.data.tokenizer_sha256 == tokenizer_sha256(config_json(tmp_path / "cache"))


@pytest.mark.timeout(300)
def test_a_pretokenized_corpus_sizes_the_model_by_data_vocab_size(tmp_path):
    """Ids of a .npy corpus beyond 255 need an embedding row each: the model takes
    data.vocab_size, and ids beyond it are refused in one line before anything starts
    (before, a uint16 corpus trained a 256-row embedding and failed deep in a rank)."""
    ids = (np.arange(60_000) * 7919 % 1000).astype(np.uint16)  # ids 0..999
    path = tmp_path / "ids.npy"
    np.save(path, ids)
    common = ["--set", "data.source=path", "--set", f"data.path={path}"]
    config = load_config(None, [arg for arg in common if arg != "--set"])
    assert config.resolved_model().vocab_size == 4096
    job_corpus(config)  # ids 0..999 fit
    small = load_config(None, [*(a for a in common if a != "--set"), "data.vocab_size=512"])
    with pytest.raises(ConfigError, match="holds token id 999.*data.vocab_size to at least 1000"):
        job_corpus(small)
    run_dir = tmp_path / "run"
    # One rank a site, one held-out batch: what is tested is the embedding's size, which
    # neither changes (the held-out loss is not read; 16 batches cost seconds a site).
    result = run_cli(
        "local", "--steps", "3", "--set", "model.preset=tiny", *common,
        "--ranks-per-site", "1", "--set", "run.eval_batches=1",
        "--run-dir", str(run_dir), timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas            identical" in result.stdout
    refused = run_cli(
        "local", "--set", "data.vocab_size=512", *common, "--run-dir", str(tmp_path / "no"),
        timeout=60,
    )  # fmt: skip
    assert_one_line_error(refused, "holds token id 999")
    assert not (tmp_path / "no").exists()
