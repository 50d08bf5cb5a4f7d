"""The default corpus (the standard library's bytes) is walked once per install and read
from data.cache_dir after that (intra/corpus/cache.py): every rank and launcher loads it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from helpers import job_corpus

import isthmus.intra.corpus.cache as corpus_module
from isthmus.deploy.config.job import load_config
from isthmus.intra.corpus.tokens import stdlib_corpus


def test_the_stdlib_corpus_is_walked_once_then_read_from_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    job = [f"data.cache_dir={cache}", "data.max_bytes=200000"]
    first, split = job_corpus(load_config(None, job))
    walked = stdlib_corpus(200_000)
    assert np.array_equal(first.tokens, walked.tokens) and first.name == walked.name
    assert [p.name[:7] for p in cache.iterdir()] == ["stdlib-"]  # one entry, no temp files

    def no_walk(max_bytes):
        raise AssertionError("walked the standard library again")

    monkeypatch.setattr(corpus_module, "stdlib_corpus", no_walk)
    again, split_again = job_corpus(load_config(None, job))
    assert np.array_equal(again.tokens, walked.tokens) and again.name == walked.name
    assert split_again == split
    # Another cap is another entry, never the first one's bytes.
    monkeypatch.undo()
    shorter, _ = job_corpus(load_config(None, [f"data.cache_dir={cache}", "data.max_bytes=2000"]))
    assert np.array_equal(shorter.tokens, walked.tokens[:2000])
    assert len(list(cache.iterdir())) == 2


def test_a_cache_folder_that_cannot_be_written_costs_the_walk_not_the_job(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    job = [f"data.cache_dir={blocked / 'cache'}", "data.max_bytes=5000"]
    for _ in range(2):
        loaded, _split = job_corpus(load_config(None, job))
        assert np.array_equal(loaded.tokens, stdlib_corpus(5000).tokens)


def test_a_launcher_loads_the_corpus_without_importing_torch(tmp_path):
    """`isthmus local` loads the corpus before it starts any rank: torch's import (1-2 s
    on a small machine) would hold every rank back."""
    code = (
        "import sys; from isthmus.deploy.config.job import load_config; "
        "from isthmus.intra.corpus.cache import load_corpus; import isthmus.deploy.launch.local; "
        "c = load_config(None, sys.argv[1:]); load_corpus(c.data, seq_len=c.train.seq_len, "
        "vocab=c.resolved_model().vocab_size); print('torch' in sys.modules)"
    )
    args = [f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=5000"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]
