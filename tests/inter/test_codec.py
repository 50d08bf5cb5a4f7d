"""Codecs: exact round trips, checksums, spec parsing, hostile payloads."""

from __future__ import annotations

import pytest
import torch
import zstandard

from isthmus.inter.data.codecs.chain import CodecError, crc32, make_codec
from isthmus.inter.data.codecs.fp32 import Fp32Stage
from isthmus.inter.data.codecs.zstd import ZstdStage

pytestmark = pytest.mark.timeout(30)


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[::7] = 0.0  # some zero runs so zstd has something to find
    return x


@pytest.mark.parametrize("spec", ["raw", "zstd", "zstd:3", "zstd:-1"])
@pytest.mark.parametrize("n", [1, 3, 1000, 262_144])
def test_round_trip_is_exact(spec: str, n: int) -> None:
    codec = make_codec(spec)
    x = _values(n)
    y = codec.decode(codec.encode(x), n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert torch.equal(x, y)
    y.add_(1.0)  # the decoded tensor is writable and owns its memory


def test_raw_is_fp32_little_endian() -> None:
    assert make_codec("raw").encode(torch.tensor([1.0])) == b"\x00\x00\x80\x3f"


def test_codec_names() -> None:
    assert make_codec("raw").name == "raw"
    assert make_codec("zstd").name == "raw+zstd:1"
    assert make_codec(" ZSTD:5 ").name == "raw+zstd:5"
    assert make_codec("fp32+shuffle+zstd:3:2").name == "raw+shuffle+zstd:3"
    assert make_codec("Int8 + zstd").name == "int8+zstd:1"
    assert ZstdStage(level=2, threads=2).name == "zstd:2"


def test_zstd_threads_round_trip() -> None:
    codec = make_codec("zstd:1:2")
    x = _values(100_000)
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x)


def test_zeros_compress() -> None:
    payload = make_codec("zstd").encode(torch.zeros(262_144))
    assert len(payload) < 1024


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "zstd:",
        "zstd:x",
        "zstd:99",
        "raw:1",
        "lz4",
        "bf16+int8",
        "zstd+shuffle",
        "raw+zstd+zstd",
    ],
)
def test_make_codec_rejects_unknown(spec: str) -> None:
    with pytest.raises(ValueError, match="allowed: .*raw.*bf16.*int8.*zstd"):
        make_codec(spec)


def test_encode_rejects_wrong_input() -> None:
    for spec in ("raw", "bf16", "int8"):
        with pytest.raises(ValueError, match="1-D float32"):
            make_codec(spec).encode(torch.zeros(2, 2))
        with pytest.raises(ValueError, match="1-D float32"):
            make_codec(spec).encode(torch.zeros(4, dtype=torch.float64))


def test_crc_detects_a_flipped_byte() -> None:
    payload = make_codec("zstd").encode(_values(1000))
    flipped = bytearray(payload)
    flipped[len(flipped) // 2] ^= 0x01
    assert crc32(payload) != crc32(bytes(flipped))
    assert 0 <= crc32(payload) < 2**32


def test_raw_rejects_wrong_size() -> None:
    codec = Fp32Stage()
    payload = codec.encode(_values(10))
    with pytest.raises(CodecError, match="expected 36"):
        codec.decode(payload, 9)
    with pytest.raises(CodecError):
        codec.decode(payload[:-1], 10)


def test_zstd_rejects_garbage() -> None:
    with pytest.raises(CodecError, match="frame header"):
        make_codec("zstd").decode(b"definitely not zstd", 4)


def test_zstd_rejects_wrong_declared_size() -> None:
    codec = make_codec("zstd")
    with pytest.raises(CodecError, match="declares 40 bytes, expected 36"):
        codec.decode(codec.encode(_values(10)), 9)


def test_zstd_rejects_bomb_with_declared_size() -> None:
    # 64 MiB of zeros compress to a few KiB; a receiver expecting 1 KiB must not
    # allocate the declared 64 MiB.
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with pytest.raises(CodecError, match="declares"):
        make_codec("zstd").decode(bomb, 256)


def test_zstd_rejects_bomb_without_declared_size() -> None:
    comp = zstandard.ZstdCompressor(write_content_size=False)
    bomb = comp.compress(bytes(64 << 20))
    assert zstandard.frame_content_size(bomb) == -1
    with pytest.raises(CodecError):
        make_codec("zstd").decode(bomb, 256)


def test_zstd_rejects_trailing_data_and_corruption() -> None:
    codec = make_codec("zstd")
    x = _values(1000, seed=1)
    payload = bytes(codec.encode(x))
    assert torch.equal(codec.decode(payload, 1000), x)  # so the junk is what is refused
    # Refused by the decompressor's allow_extra_data=False (zstd's message names them).
    with pytest.raises(CodecError, match=r"^zstd payload is corrupt: .*5 bytes of unused data"):
        codec.decode(payload + b"\x00junk", 1000)
    # zstd keeps no checksum of its own: a flipped byte may decode (to other values).
    # What guards the sum is the lane's CRC-32C, which catches every flip of one byte
    # (any burst of up to 32 bits); and no flip decodes silently to the original.
    decoded_anyway = 0
    for pos in range(len(payload)):
        corrupt = bytearray(payload)
        corrupt[pos] ^= 0xFF
        assert crc32(bytes(corrupt)) != crc32(payload), pos
        if pos % 7:
            continue
        try:
            y = codec.decode(bytes(corrupt), 1000)
        except CodecError:
            continue
        decoded_anyway += 1
        assert not torch.equal(x, y), pos
    assert decoded_anyway > 0  # so the CRC is what stands between them and the sum
