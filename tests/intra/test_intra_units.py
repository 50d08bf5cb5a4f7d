"""Pure-logic tests of isthmus.intra: no process groups."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from isthmus.intra.corpus.batches import HELD_OUT_BLOCKS, ShardedBatches, Split, split_corpus
from isthmus.intra.corpus.tokens import Corpus, from_path, stdlib_corpus
from isthmus.intra.digest import parameter_digest
from isthmus.intra.flops import PEAK_FLOPS, device_peak_flops, mfu, scaled_lr
from isthmus.intra.layout import MeshAxis, ParallelConfig, ParallelLayout
from isthmus.intra.model import Transformer, build_model
from isthmus.intra.model_config import PRESETS, ModelConfig, preset
from isthmus.intra.pipeline import rank_stages, split_stage, stage_layers
from isthmus.intra.topology import build_site_mesh
from isthmus.intra.train import TrainConfig


def test_layout_defaults_and_world_size() -> None:
    assert ParallelLayout().world_size == 1
    assert ParallelLayout(pp=2, dp=3, tp=2).world_size == 12
    assert ParallelLayout(pp=2, dp=3, cp=2, tp=2).world_size == 24
    assert [a.value for a in MeshAxis] == ["pp", "dp", "cp", "tp"]


@pytest.mark.parametrize("field", ["pp", "dp", "cp", "tp"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_layout_rejects_bad_sizes(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"ParallelLayout\.{field}") as err:
        ParallelLayout(**{field: value})
    assert "\n" not in str(err.value)


def test_for_ranks_derives_dp() -> None:
    assert ParallelLayout.for_ranks(8, pp=2, tp=2) == ParallelLayout(pp=2, dp=2, tp=2)
    assert ParallelLayout.for_ranks(4) == ParallelLayout(dp=4)
    assert ParallelLayout.for_ranks(8, tp=2, cp=2) == ParallelLayout(dp=2, cp=2, tp=2)


def test_for_ranks_message_is_one_line() -> None:
    with pytest.raises(
        ValueError, match=r"^ranks_per_site=6 is not divisible by pp\*cp\*tp=4"
    ) as err:
        ParallelLayout.for_ranks(6, pp=2, tp=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="ranks_per_site"):
        ParallelLayout.for_ranks(0)


def test_mesh_refuses_a_world_size_mismatch() -> None:
    with pytest.raises(ValueError, match="device_type"):
        build_site_mesh(ParallelLayout(tp=2, dp=1), device_type="tpu")


def test_model_config_validation() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(dim=65, n_layers=1, n_heads=4, ffn_hidden=8, max_seq_len=8)
    with pytest.raises(ValueError, match="must be even"):
        ModelConfig(dim=12, n_layers=1, n_heads=4, ffn_hidden=8, max_seq_len=8)
    with pytest.raises(ValueError, match="ModelConfig.n_layers"):
        ModelConfig(dim=8, n_layers=0, n_heads=2, ffn_hidden=8, max_seq_len=8)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")


def test_presets_sizes_and_flops() -> None:
    expect = {"tiny": (0.1e6, 0.3e6), "small": (1e6, 3e6), "125m": (100e6, 150e6)}
    expect |= {"350m": (300e6, 420e6), "1b": (0.9e9, 1.3e9)}
    for name, (lo, hi) in expect.items():
        with torch.device("meta"):
            model = Transformer(PRESETS[name])
        assert lo <= model.num_params() <= hi, name
        assert PRESETS[name].num_params == model.num_params(), name  # counted unbuilt
        n = model.num_params(exclude_embedding=True)
        cfg = PRESETS[name]
        assert model.flops_per_token(64) == 6 * n + 12 * cfg.n_layers * cfg.dim * 64


def test_model_forward_shape_and_seed() -> None:
    cfg = preset("tiny")
    model = build_model(cfg, seed=3)
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert parameter_digest(model) == parameter_digest(build_model(cfg, seed=3))
    assert parameter_digest(model) != parameter_digest(build_model(cfg, seed=4))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_model_is_causal() -> None:
    model = build_model(preset("tiny"), seed=0)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    # Changing tokens 8.. must not change the logits at positions < 8.
    torch.testing.assert_close(model(x)[:, :8], model(y)[:, :8], rtol=0, atol=0)


def _corpus(n: int = 5000) -> Corpus:
    return Corpus(tokens=(np.arange(n) % 251).astype(np.uint8), name="ramp")


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_shards_union_equals_unsharded_batch(num_shards: int) -> None:
    corpus, b = _corpus(), 3
    whole = ShardedBatches(corpus, seq_len=16, batch_size=num_shards * b, seed=7)
    for step in (0, 1, 41):
        parts = [
            ShardedBatches(
                corpus, seq_len=16, batch_size=b, seed=7, shard_index=k, num_shards=num_shards
            ).batch(step)
            for k in range(num_shards)
        ]
        inputs, targets = whole.batch(step)
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)


def test_a_split_of_the_global_batch_into_units_keeps_the_same_windows() -> None:
    """Sites of different speeds take different numbers of micro-batches (units): a
    site-major split of the same global batch, in any proportions, is the same set."""
    corpus, b = _corpus(), 2
    whole = ShardedBatches(corpus, seq_len=16, batch_size=6 * b, seed=3).batch(9)[0]
    for counts in ([2, 1, 3], [1, 1, 4], [6]):
        first, parts = 0, []
        for units in counts:
            data = ShardedBatches(
                corpus, seq_len=16, batch_size=b, seed=3, shard_index=first, num_shards=6,
                units=units,
            )  # fmt: skip
            parts.append(data.batch(9)[0])
            assert parts[-1].shape == (units * b, 16)
            first += units
        assert torch.equal(torch.cat(parts), whole)
    with pytest.raises(ValueError, match="units=3 must lie in"):
        ShardedBatches(
            corpus, seq_len=8, batch_size=1, seed=0, shard_index=4, num_shards=6, units=3
        )


def test_batches_are_deterministic_and_shifted() -> None:
    data = ShardedBatches(_corpus(), seq_len=32, batch_size=4, seed=1, shard_index=1, num_shards=2)
    x, y = data.batch(5)
    assert x.dtype == torch.int64 and x.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, data.batch(5)[0])
    assert not torch.equal(x, data.batch(6)[0])
    with pytest.raises(ValueError, match="shard_index"):
        ShardedBatches(_corpus(), seq_len=8, batch_size=1, seed=0, shard_index=2, num_shards=2)


def test_held_out_blocks_are_spread_and_never_trained_on() -> None:
    n, seq = 400_000, 32
    split = split_corpus(n, 0.01, seq)
    assert abs(split.held_out_tokens / n - 0.01) < 0.001
    # Blocks over the whole corpus, not one end: the standard library is sorted by path.
    assert len(split.held_out) == HELD_OUT_BLOCKS
    assert split.held_out[0][0] < n / 8 and split.held_out[-1][1] > n * 7 / 8
    # Train and held-out spans tile the corpus without overlap.
    spans = sorted(split.train + split.held_out)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    # Every token a training window reads (inputs and targets) is a training token.
    corpus = Corpus(tokens=np.zeros(n, dtype=np.uint8), name="zeros")
    held = np.zeros(n, dtype=bool)
    for lo, hi in split.held_out:
        held[lo:hi] = True
    train = ShardedBatches(corpus, seq_len=seq, batch_size=64, seed=3, spans=split.train)
    val = ShardedBatches(corpus, seq_len=seq, batch_size=64, seed=3, spans=split.held_out)
    for step in range(200):
        for data, inside in ((train, False), (val, True)):
            starts = data.window_starts(step)
            windows = starts[:, None] + np.arange(seq + 1)[None, :]
            assert (held[windows] == inside).all(), (step, inside)


def test_whole_corpus_span_draws_what_no_spans_draws() -> None:
    # val_fraction = 0 keeps every job's data exactly as before the split existed.
    corpus = _corpus()
    assert split_corpus(len(corpus), 0.0, 16) == Split.whole(len(corpus))
    old = ShardedBatches(corpus, seq_len=16, batch_size=4, seed=9)
    new = ShardedBatches(corpus, seq_len=16, batch_size=4, seed=9, spans=[(0, len(corpus))])
    for step in (0, 7):
        assert torch.equal(old.batch(step)[0], new.batch(step)[0])


def test_a_corpus_too_short_to_split_is_refused_in_one_line() -> None:
    # A small corpus still gets one held-out block (its middle one) ...
    split = split_corpus(5000, 0.01, 128)
    assert len(split.held_out) == 1 and split.held_out_tokens == 258
    # ... until three blocks no longer fit.
    with pytest.raises(ValueError, match=r"too short .* data.val_fraction=0"):
        split_corpus(700, 0.01, 128)
    with pytest.raises(ValueError, match=r"\[0, 0.5\]"):
        split_corpus(5000, 0.6, 16)
    with pytest.raises(ValueError, match="no window"):
        ShardedBatches(_corpus(), seq_len=16, batch_size=1, seed=0, spans=[(0, 10)])


def test_stdlib_corpus_capped() -> None:
    corpus = stdlib_corpus(max_bytes=1 << 16)
    assert len(corpus) == 1 << 16 and corpus.tokens.dtype == np.uint8
    assert np.array_equal(corpus.tokens, stdlib_corpus(max_bytes=1 << 16).tokens)


def test_from_path_kinds(tmp_path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_bytes(b"world")
    (tmp_path / "d" / "a.txt").write_bytes(b"hello ")
    assert bytes(from_path(tmp_path / "d").tokens) == b"hello world"
    assert bytes(from_path(tmp_path / "d" / "a.txt", max_bytes=3).tokens) == b"hel"
    ids = np.array([1, 300, 65535], dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids)
    assert from_path(tmp_path / "t.bin", dtype="uint16").tokens.tolist() == [1, 300, 65535]
    assert from_path(tmp_path / "t.npy").tokens.dtype == np.uint16
    with pytest.raises(ValueError, match="does not exist"):
        from_path(tmp_path / "missing")


def test_lr_schedule_and_validation() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, total_steps=14)
    assert [cfg.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(cfg.lr_at(9), 0.55)
    assert math.isclose(cfg.lr_at(14), 0.1) and math.isclose(cfg.lr_at(99), 0.1)
    with pytest.raises(ValueError, match="TrainConfig.warmup_steps"):
        TrainConfig(warmup_steps=5, total_steps=4)
    with pytest.raises(ValueError, match="TrainConfig.betas"):
        TrainConfig(betas=(0.9, 1.0))


def test_parallel_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"ParallelConfig\.schedule"):
        ParallelConfig(schedule="zb")
    with pytest.raises(ValueError, match=r"ParallelConfig\.microbatches"):
        ParallelConfig(microbatches=0)
    with pytest.raises(ValueError, match=r"ParallelConfig\.stages_per_rank must be >= 2"):
        ParallelConfig(schedule="interleaved_1f1b", stages_per_rank=1)
    with pytest.raises(ValueError, match=r"ParallelConfig\.stages_per_rank must be 1"):
        ParallelConfig(schedule="gpipe", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"ParallelConfig\.compile"):
        ParallelConfig(compile="yes")
    assert ParallelConfig(schedule="interleaved_1f1b").local_stages == 2
    assert ParallelConfig().num_microbatches(4) == 4


def test_parallel_config_check_against_layout_and_model() -> None:
    tiny = preset("tiny")
    ParallelConfig().check(ParallelLayout(tp=4), tiny, batch_size=2, seq_len=16)
    with pytest.raises(
        ValueError, match=r"ModelConfig\.n_heads=4 must be divisible by ParallelLayout\.tp=8"
    ):
        ParallelConfig().check(ParallelLayout(tp=8), tiny, batch_size=2, seq_len=16)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(sequence_parallel=True).check(
            ParallelLayout(tp=4), tiny, batch_size=2, seq_len=18
        )
    with pytest.raises(ValueError, match=r"ModelConfig\.n_layers=2"):
        ParallelConfig(schedule="interleaved_1f1b").check(
            ParallelLayout(pp=2), tiny, batch_size=4, seq_len=16
        )
    with pytest.raises(ValueError, match=r"microbatches=3 must divide"):
        ParallelConfig(microbatches=3).check(ParallelLayout(pp=2), tiny, batch_size=4, seq_len=16)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_1b_preset_fits_tensor_parallel(tp: int) -> None:
    # Whole heads per rank, and per-rank MLP widths that stay multiples of 64
    # (tensor-core friendly: 1408 at tp=4, 704 at tp=8).
    cfg = PRESETS["1b"]
    ParallelConfig(sequence_parallel=True).check(
        ParallelLayout(tp=tp), cfg, batch_size=8, seq_len=2048
    )
    assert cfg.head_dim == 128 and (cfg.ffn_hidden // tp) % 64 == 0


def test_stage_split_keeps_names() -> None:
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert rank_stages(1, pp=2, stages_per_rank=2) == [1, 3]
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layers(2, 4)
    model = build_model(replace(preset("tiny"), n_layers=4), seed=0)
    parts = [split_stage(model, s, 2) for s in range(2)]
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    x = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(parts[1](parts[0](x)), model(x), rtol=0, atol=0)


def test_scaled_lr_rules() -> None:
    assert scaled_lr(1e-3, 8, "linear") == pytest.approx(8e-3)
    assert scaled_lr(1e-3, 8, "sqrt", reference_dp=2) == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 8, "none") == 1e-3
    with pytest.raises(ValueError, match="rule"):
        scaled_lr(1e-3, 8, "cubic")
    with pytest.raises(ValueError, match="dp_total"):
        scaled_lr(1e-3, 0)


def test_mfu_and_peak() -> None:
    assert device_peak_flops("cpu") == PEAK_FLOPS["cpu"]
    # 1B model, ~6.6 GFLOP/token: 60k tokens/s on 1 H100 is ~40%.
    fpt = 6.6e9
    assert mfu(60_000, fpt, PEAK_FLOPS["H100"], 1) == pytest.approx(0.4, rel=0.01)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0, 1)
