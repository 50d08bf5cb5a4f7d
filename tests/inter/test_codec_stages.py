"""Codec chains: bf16, int8 with error feedback, byte-shuffle; state round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from isthmus.inter.data.codecs.chain import CodecError, make_codec
from isthmus.inter.data.codecs.int4 import Int4Stage
from isthmus.inter.data.codecs.int8 import BLOCK, Int8Stage
from isthmus.inter.data.codecs.shuffle import ShuffleStage

pytestmark = pytest.mark.timeout(30)

LOSSLESS = ["raw", "raw+shuffle", "raw+shuffle+zstd:1", "zstd:3:2"]
LOSSY = [
    "bf16",
    "bf16+shuffle+zstd:3",
    "int8",
    "int8+zstd:1",
    "int8+shuffle+zstd:1",
    "int4",
    "int4+zstd:1",
]


def _grad(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 1e-3


@pytest.mark.parametrize("spec", LOSSLESS)
@pytest.mark.parametrize("n", [1, 3, 4097])
def test_lossless_chains_round_trip_exactly(spec: str, n: int) -> None:
    codec = make_codec(spec)
    x = _grad(n)
    assert not codec.lossy and torch.equal(codec.decode(codec.encode(x), n), x)


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("n", [1, 3, 4097])
def test_lossy_chains_round_trip_within_their_precision(spec: str, n: int) -> None:
    codec = make_codec(spec)
    x = _grad(n, seed=n)
    y = codec.decode(codec.encode(x), n)
    assert codec.lossy and y.dtype == torch.float32 and y.shape == (n,)
    if spec.startswith("bf16"):
        # bf16 keeps 8 mantissa bits: relative error at most 2^-9 after rounding.
        assert torch.all((y - x).abs() <= x.abs() * 2**-8)
    else:
        levels = 7 if spec.startswith("int4") else 127
        scale = x.abs().max() / levels  # rounding to the nearest step: half a step at most
        assert torch.all((y - x).abs() <= scale / 2 * (1 + 1e-5))
    y.add_(1.0)  # writable


def test_payload_sizes() -> None:
    x = _grad(1000)
    assert len(make_codec("raw").encode(x)) == 4000
    assert len(make_codec("bf16").encode(x)) == 2000
    assert len(make_codec("int8").encode(x)) == 1004  # fp32 scale + one byte each
    assert len(make_codec("int4").encode(x)) == 504  # fp32 scale + half a byte each
    assert len(make_codec("int4").encode(_grad(1001))) == 505  # the last byte half used


def test_int4_packs_two_levels_per_byte_low_nibble_first() -> None:
    stage = Int4Stage(error_feedback=False)
    x = torch.tensor([7.0, -7.0, 0.0, 3.0, -1.0])  # scale 1: the levels themselves
    payload = bytes(stage.encode(x))
    assert payload[4:] == bytes([(7 + 8) | (-7 + 8) << 4, 8 | (3 + 8) << 4, (-1 + 8) | 8 << 4])
    assert torch.equal(stage.decode(payload, 5), x)
    # The device decode (what a CUDA round runs) gives the host's bits.
    assert torch.equal(stage.decode_device(payload, 5, torch.device("cpu")), x)
    with pytest.raises(CodecError, match="int4 payload has 6 bytes, expected 7"):
        stage.decode(payload[:-1], 5)
    # A hostile nibble 0 decodes to level -8: finite, never out of bounds.
    assert float(stage.decode(payload[:4] + bytes([0, 0, 0]), 5)[0]) == -8.0


def test_int4_error_feedback_tracks_the_sum_and_forgets_a_nan() -> None:
    with_ef, without = Int4Stage(), Int4Stage(error_feedback=False)
    total, fed, plain = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    for step in range(40):
        g = _grad(4096, seed=step)
        total += g
        fed += with_ef.decode(with_ef.encode(g, "k"), 4096)
        plain += without.decode(without.encode(g, "k"), 4096)
    # Feedback keeps the drift at one rounding; without it the errors add up.
    assert (fed - total).abs().max() < 0.5 * (plain - total).abs().max()
    bad = _grad(4096).clone()
    bad[7] = float("nan")
    assert torch.isnan(with_ef.decode(with_ef.encode(bad, "k"), 4096)).all()
    assert "k" not in with_ef.state_dict()  # the NaN left no residual behind


def test_shuffle_round_trip_keeps_a_tail() -> None:
    stage = ShuffleStage(4)
    data = bytes(range(11))  # two whole elements and a 3-byte tail
    shuffled = stage.encode(data)
    assert shuffled[:8] == bytes([0, 4, 1, 5, 2, 6, 3, 7]) and shuffled[8:] == data[8:]
    assert stage.decode(shuffled, 11) == data
    with pytest.raises(CodecError):
        stage.decode(shuffled, 12)


def test_shuffle_helps_zstd_on_gradients() -> None:
    x = _grad(262_144)
    plain = len(make_codec("raw+zstd:1").encode(x))
    shuffled = len(make_codec("raw+shuffle+zstd:1").encode(x))
    assert shuffled < plain * 0.95


@pytest.mark.parametrize("spec", ["bf16", "int8", "int8+zstd:1"])
def test_lossy_decode_rejects_wrong_size(spec: str) -> None:
    codec = make_codec(spec)
    payload = codec.encode(_grad(10))
    with pytest.raises(CodecError):
        codec.decode(payload, 9)
    with pytest.raises(CodecError):
        codec.decode(bytes(payload) + b"\x00", 10)


# --- error feedback ------------------------------------------------------------------


def test_residual_carries_the_quantization_error() -> None:
    codec = make_codec("int8")
    x = _grad(5000)
    y = codec.decode(codec.encode(x, "g0/c0"), 5000)
    residual = codec.state_dict()["g0/c0"]
    assert torch.equal(residual, x - y)  # exactly what was lost, nothing else
    # The next encode of that key adds it back before quantizing.
    z = _grad(5000, seed=1)
    y2 = codec.decode(codec.encode(z, "g0/c0"), 5000)
    assert torch.allclose(codec.state_dict()["g0/c0"], z + residual - y2, atol=1e-12)
    # No key, no feedback and no state.
    codec.encode(z)
    assert list(codec.state_dict()) == ["g0/c0"]


def test_long_run_sum_tracks_the_true_sum() -> None:
    # One large coordinate makes the scale coarse, so the small ones round to zero
    # every step; only error feedback lets them through over time.
    with_ef, without = make_codec("int8"), Int8Stage(error_feedback=False)
    n, steps = 1000, 200
    true = torch.zeros(n)
    sums = {"ef": torch.zeros(n), "plain": torch.zeros(n)}
    for step in range(steps):
        # A small bias below half a step (1/254): without feedback it is lost for ever.
        x = 1e-3 + _grad(n, seed=step)
        x[0] = 1.0
        true += x
        sums["ef"] += with_ef.decode(with_ef.encode(x, "k"), n)
        sums["plain"] += without.decode(without.encode(x, "k"), n)
    err_ef = (sums["ef"] - true)[1:].abs().max()
    err_plain = (sums["plain"] - true)[1:].abs().max()
    assert true[1:].mean() > 0.15
    # With feedback the error stays at one quantization step (scale/2 = 1/254).
    assert err_ef <= 1 / 254 + 1e-6
    assert err_plain > 5 * err_ef


def test_state_dict_round_trip_resumes_identically() -> None:
    a, b = make_codec("int8+zstd:1"), make_codec("int8+zstd:1")
    for step in range(3):
        a.encode(_grad(300, seed=step), "g1/c2")
    b.load_state_dict(a.state_dict())
    x = _grad(300, seed=9)
    assert a.encode(x, "g1/c2") == b.encode(x, "g1/c2")
    with pytest.raises(ValueError, match="keeps no state"):
        make_codec("raw").load_state_dict({"k": torch.zeros(1)})


def test_residual_of_another_shape_is_dropped_and_nan_does_not_poison() -> None:
    codec = make_codec("int8")
    codec.encode(_grad(100), "k")
    codec.encode(_grad(50), "k")  # a new layout: the old residual is not added
    assert codec.state_dict()["k"].shape == (50,)
    bad = _grad(50)
    bad[3] = math.inf
    assert torch.isnan(codec.decode(codec.encode(bad, "k"), 50)).all()
    assert "k" not in codec.state_dict()
    x = _grad(50, seed=4)
    assert torch.isfinite(codec.decode(codec.encode(x, "k"), 50)).all()


@pytest.mark.parametrize("stage_type", [Int8Stage, Int4Stage])
@pytest.mark.parametrize("values", ["gradient", "zeros", "nan", "inf"])
def test_each_block_of_values_has_its_own_scale(stage_type: type, values: str) -> None:
    """A large value costs the precision of its own block only (one scale per chunk
    rounded most of a chunk's gradient to zero: +16 % held-out loss with int8 on the
    CPU quality table). The residual is exactly input minus decode, the device decode
    (what a CUDA round runs) gives the host's bits, and a non-finite value anywhere
    sends the chunk as NaN and keeps no residual."""
    levels = 127 if stage_type is Int8Stage else 7
    n = 3 * BLOCK + 5  # four blocks, the last one short
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-3
    x[10] = 1.0  # block 0's scale is a thousand times the others'
    if values == "zeros":
        x = torch.zeros(n)
    elif values in ("nan", "inf"):
        x[BLOCK + 17] = math.nan if values == "nan" else math.inf
    stage = stage_type()
    payload = bytes(stage.encode(x.clone(), "k"))
    per_byte = 1 if stage_type is Int8Stage else 2
    assert len(payload) == 4 * 4 + -(-n // per_byte)
    decoded = stage.decode(payload, n)
    on_device = stage.decode_device(payload, n, torch.device("cpu"))
    if values in ("nan", "inf"):
        assert decoded.isnan().all() and on_device.isnan().all()
        assert "k" not in stage.state_dict()
        return
    assert torch.equal(on_device, decoded)
    assert torch.equal(stage.state_dict()["k"], x - decoded)
    for b in range(4):
        block = slice(b * BLOCK, min(n, (b + 1) * BLOCK))
        step = x[block].abs().max().item() / levels
        assert torch.all((decoded[block] - x[block]).abs() <= step / 2 + 1e-12), b
    if values == "gradient":  # blocks 1-3 keep their small values
        assert decoded[BLOCK:].abs().max() < 0.01 and (decoded[BLOCK:] != 0).float().mean() > 0.6


def test_a_site_with_another_payload_layout_is_refused_at_join() -> None:
    """int8's layout changed (a scale per block): a site of the release before would
    fail every chunk's size check, so the fingerprint names the layout's version."""
    from isthmus.deploy.config.job import load_config
    from isthmus.inter.control.fingerprint import fingerprint_problem
    from isthmus.inter.data.codecs.spec import CODEC_FORMAT

    ours = load_config(None, ["sync.codec=int8"]).fingerprint()
    assert ours["sync.codec_format"] == str(CODEC_FORMAT)
    older = {k: v for k, v in ours.items() if k != "sync.codec_format"}
    problem = fingerprint_problem(ours, older, "site0", "site1")
    assert problem is not None and "sync.codec_format" in problem


@pytest.mark.parametrize(("stage_type", "largest"), [(Int8Stage, 128), (Int4Stage, 8)])
def test_finite_reads_a_payload_exactly_as_its_decode_will(stage_type: type, largest: int) -> None:
    """A received chunk is checked off its bytes, not its decoded values: a forged
    finite scale whose product with the largest integer overflows must count as
    non-finite, and the largest scale that cannot overflow as finite."""
    stage, n = stage_type(), 2 * BLOCK
    payload = bytearray(stage.encode(torch.ones(n), None))
    assert stage.finite(bytes(payload), n)
    # The wire's most negative integer everywhere (int8 -128; int4's nibble 0 is -8).
    head = 4 * (n // BLOCK)
    payload[head:] = bytes(len(payload) - head)
    if stage_type is Int8Stage:
        payload[head:] = b"\x80" * (len(payload) - head)
    fp32_max = torch.finfo(torch.float32).max
    for scale, finite in [(fp32_max / largest, True), (fp32_max / largest * 1.001, False),
                          (1e38, False), (math.inf, False), (math.nan, False)]:  # fmt: skip
        payload[4:8] = torch.tensor([scale], dtype=torch.float32).numpy().tobytes()
        with np.errstate(over="ignore"):  # the point of the overflowing cases
            decoded = stage.decode(bytes(payload), n)
        assert stage.finite(bytes(payload), n) is finite, scale
        assert bool(torch.isfinite(decoded).all()) is finite, scale
