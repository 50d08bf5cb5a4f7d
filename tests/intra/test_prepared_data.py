"""A prepared folder (`isthmus data prepare`) read back: its shards memory-mapped as one
token sequence, batches drawn from it as from the same tokens in memory, and a folder
that is not whole refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from isthmus.intra.corpus.batches import ShardedBatches, split_corpus
from isthmus.intra.corpus.tokens import (
    PREPARED_FORMAT,
    PREPARED_VERSION,
    Corpus,
    ShardedTokens,
    prepared_corpus,
)


def _write_folder(folder: Path, tokens: np.ndarray, sizes: list[int]) -> None:
    """The layout intra/corpus/prepare.py writes: uint16 .bin shards and a manifest naming them."""
    folder.mkdir()
    shards, start = [], 0
    for k, size in enumerate(sizes):
        name = f"shard-{k:05d}.bin"
        tokens[start : start + size].astype(np.uint16).tofile(folder / name)
        shards.append({"file": name, "tokens": size})
        start += size
    assert start == len(tokens)
    manifest = {
        "format": PREPARED_FORMAT,
        "version": PREPARED_VERSION,
        "dtype": "uint16",
        "tokens": len(tokens),
        "shards": shards,
        "tokenizer": {"sha256": "0" * 64},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 5000, size=3000).astype(np.uint16)


def test_shards_read_as_one_sequence_also_across_their_borders(tmp_path, tokens) -> None:
    _write_folder(tmp_path / "p", tokens, [1000, 7, 1993])
    corpus, manifest = prepared_corpus(tmp_path / "p")
    view = corpus.tokens
    assert isinstance(view, ShardedTokens) and len(corpus) == 3000 == manifest["tokens"]
    assert all(isinstance(a, np.memmap) for a in view.shards)
    # Windows that start in one shard and end in the next (and one spanning the 7-token one).
    windows = np.array(
        [[995, 996, 997, 998, 999, 1000, 1001], [1002, 1003, 1004, 1005, 1006, 1007, 1008]]
    )
    assert np.array_equal(view[windows], tokens[windows])
    assert np.array_equal(view[990:1010], tokens[990:1010])
    assert view.max() == int(tokens.max())
    with pytest.raises(IndexError):
        view[np.array([3000])]


def test_batches_of_every_site_and_rank_are_those_of_the_same_tokens_in_memory(
    tmp_path, tokens
) -> None:
    _write_folder(tmp_path / "p", tokens, [1000, 1000, 1000])
    prepared, _ = prepared_corpus(tmp_path / "p")
    in_memory = Corpus(tokens=tokens, name="memory")
    split = split_corpus(len(tokens), 0.1, 16)
    assert split.held_out  # the validation blocks are held out of the prepared tokens too
    for shard in range(4):  # 2 sites x 2 ranks: shard = site * dp + rank
        args = dict(seq_len=16, batch_size=3, seed=7, shard_index=shard, num_shards=4)
        a = ShardedBatches(prepared, spans=split.train, **args)
        b = ShardedBatches(in_memory, spans=split.train, **args)
        # Step s's batch is drawn from (seed, s) alone: a resumed run at step 5 reads
        # exactly what an uninterrupted one does.
        for step in (0, 5, 9):
            for x, y in zip(a.batch(step), b.batch(step), strict=True):
                assert x.equal(y)
            starts = a.window_starts(step)
            assert all(any(lo <= s and s + 17 <= hi for lo, hi in split.train) for s in starts)


def test_a_folder_that_is_not_whole_is_refused_in_one_line(tmp_path, tokens) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        prepared_corpus(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no manifest.json"):
        prepared_corpus(tmp_path / "empty")
    _write_folder(tmp_path / "p", tokens, [2000, 1000])
    with open(tmp_path / "p" / "shard-00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        ValueError, match=r"shard-00001.bin holds 100 bytes, the manifest says 1000"
    ):
        prepared_corpus(tmp_path / "p")
    (tmp_path / "p" / "shard-00001.bin").unlink()
    with pytest.raises(ValueError, match="shard-00001.bin is missing"):
        prepared_corpus(tmp_path / "p")
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    (tmp_path / "p" / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ValueError, match="is not a version-1 isthmus-tokens manifest"):
        prepared_corpus(tmp_path / "p")
