"""The one-pass work on a raw CPU chunk's bytes (wirecore.c ``wc_sum_f32``, ``wc_crc32c_f32``).

The owner's sum replaces four passes (the own part's finite check, numpy's adds and divide, the
result's finite check, its CRC-32C), so it must give exactly what they gave: the same
bits in the same site order, the same CRC, and the same refusals (a NaN or Inf in this
site's own part; a sum that overflows). A sender's checksum with its NaN/Inf check
replaces two.
"""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch
from lanes import inputs, lane_pair, run_all, same_bits

from isthmus.inter.data.codecs.chain import make_codec
from isthmus.inter.data.round import tasks as round_tasks
from isthmus.inter.data.round.context import EncodingFault, NonFiniteGradient, PeerAborted
from isthmus.inter.data.round.device import sum_parts, sum_raw_host
from isthmus.inter.data.transport import wirecore

pytestmark = pytest.mark.timeout(120)

# Not a multiple of the C block (24,576 values) nor of the CRC's 8 KiB lanes.
SIZES = [1, 5, 24_576, 24_576 * 3 + 1001, (4 << 20) // 4 + 3]


@pytest.fixture(autouse=True)
def _native() -> None:
    # The install builds the extension (setup.py); without it there is nothing to
    # compare, and the lanes would run the numpy passes, which other tests cover.
    assert wirecore.one_pass_sums(), "wirecore's C extension is not built"


def _parts(sites: int, n: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Values of mixed magnitude, so the order of the adds changes low bits.
    return {
        s: (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
        for s in range(sites)
    }


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("num_sites", [2, 3, 4])
@pytest.mark.parametrize("average", [True, False])
def test_the_sum_has_numpys_bits_and_the_checksum_of_its_bytes(n, num_sites, average) -> None:
    for own in range(num_sites):  # the owner's part is the output's memory, as in a round
        parts = _parts(num_sites, n, seed=n + own)
        expected = sum_parts({s: p.copy() for s, p in parts.items()}, np.empty(n, np.float32),
                             num_sites, average)  # fmt: skip
        out = parts[own]
        status, crc = sum_raw_host(parts, out, own, num_sites, average)
        assert status == wirecore.SUM_OK
        assert out.tobytes() == expected.tobytes()
        assert crc == crc32c.crc32c(expected.tobytes())


def test_a_part_that_does_not_start_on_a_word_is_copied_first() -> None:
    parts = _parts(2, 10_000, seed=3)
    raw = bytearray(parts[1].nbytes + 1)
    moved = np.frombuffer(memoryview(raw)[1:], dtype=np.float32)  # one byte off
    moved[:] = parts[1]
    assert moved.ctypes.data % 4
    expected = parts[0] + parts[1]
    status, crc = sum_raw_host({0: parts[0], 1: moved}, parts[0], 0, 2, False)
    assert (status, parts[0].tobytes()) == (wirecore.SUM_OK, expected.tobytes())
    assert crc == crc32c.crc32c(expected.tobytes())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 24_576 + 7, 60_000 - 1])
def test_a_nonfinite_own_part_is_refused(bad, where) -> None:
    parts = _parts(3, 60_000, seed=7)
    parts[1][where] = bad
    status, crc = sum_raw_host(parts, parts[1], 1, 3, True)
    assert (status, crc) == (wirecore.SUM_OWN_NONFINITE, 0)


def test_a_sum_that_overflows_is_told_apart_from_a_nonfinite_part() -> None:
    parts = _parts(2, 30_000, seed=9)
    parts[0][29_999] = parts[1][29_999] = np.float32(3e38)
    assert np.isfinite(parts[0]).all() and np.isfinite(parts[1]).all()
    status, _ = sum_raw_host(parts, parts[0], 0, 2, False)
    assert status == wirecore.SUM_OVERFLOW


@pytest.mark.parametrize("n", SIZES)
def test_a_senders_checksum_is_its_bytes_crc_and_refuses_nan_and_inf(n) -> None:
    values = _parts(1, n, seed=n)[0]
    assert wirecore.crc_of_finite(values) == crc32c.crc32c(values.tobytes())
    for where in {0, n // 2, n - 1}:
        for bad in (float("nan"), float("inf"), -float("inf")):
            broken = values.copy()
            broken[where] = bad
            assert wirecore.crc_of_finite(broken) is None


def test_without_the_library_the_caller_is_told_to_sum_on_its_own(monkeypatch) -> None:
    monkeypatch.setattr(wirecore, "load", lambda: None)
    parts = _parts(2, 100, seed=1)
    assert sum_raw_host(parts, parts[0], 0, 2, True) is None
    assert not wirecore.one_pass_sums()
    # The sender's two passes, in Python.
    assert wirecore.crc_of_finite(parts[1]) == crc32c.crc32c(parts[1].tobytes())
    parts[1][7] = float("nan")
    assert wirecore.crc_of_finite(parts[1]) is None


# --- in rounds between real lanes on loopback ---------------------------------------


@pytest.mark.parametrize("num_sites", [2, 3])
def test_a_raw_round_ends_with_the_bits_of_the_passes_it_replaced(monkeypatch, num_sites) -> None:
    sizes = [9000, 1, 4097]
    results, calls = {}, {"sum": 0, "crc": 0}
    for name, key in (("sum_raw_host", "sum"), ("crc_of_finite", "crc")):
        real = getattr(round_tasks, name)

        def counted(*args, real=real, key=key):
            calls[key] += 1
            return real(*args)

        monkeypatch.setattr(round_tasks, name, counted)
    for one_pass in (True, False):
        monkeypatch.setattr(round_tasks, "one_pass_sums", lambda one_pass=one_pass: one_pass)
        calls.update(sum=0, crc=0)
        data = inputs(num_sites, sizes, seed=5)
        with lane_pair(num_sites, "raw") as ars:
            run_all(
                [lambda s=s, d=data: ars[s].allreduce(d[s], 0, 0, True) for s in range(num_sites)]
            )
        for s in range(1, num_sites):
            assert all(same_bits(a, b) for a, b in zip(data[0], data[s], strict=True))
        results[one_pass] = data[0]
        # 13,098 values in chunks of 1,024: 13 chunks, each summed once by its owner
        # and sent to it by every other site.
        assert calls == (
            {"sum": 13, "crc": 13 * (num_sites - 1)} if one_pass else {"sum": 0, "crc": 0}
        )
    assert all(same_bits(a, b) for a, b in zip(results[True], results[False], strict=True))


def test_only_the_raw_stage_alone_takes_the_one_pass() -> None:
    assert make_codec("raw").plain_fp32
    for spec in ("raw+zstd:1", "raw+shuffle+zstd:1", "bf16", "int8"):
        assert not make_codec(spec).plain_fp32, spec


@pytest.mark.parametrize("element", [4321, 3321], ids=["owned-chunk", "sent-chunk"])
def test_a_raw_round_refuses_this_sites_nan_whichever_site_sums_it(element) -> None:
    with lane_pair(2, "raw", timeout_s=2.0) as ars:
        data = inputs(2, [9000], seed=1)
        data[0][0][element] = float("nan")  # chunk 4 is site 0's to sum, chunk 3 site 1's
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        assert isinstance(res[0], NonFiniteGradient), res[0]
        assert "this site's gradient holds NaN or Inf" in str(res[0])
        assert torch.isfinite(data[1][0]).all()


def test_a_raw_round_whose_sum_overflows_sends_no_result() -> None:
    with lane_pair(2, "raw", timeout_s=2.0) as ars:
        data = inputs(2, [9000], seed=1)
        data[0][0][4321] = data[1][0][4321] = 3e38  # chunk 4: site 0 sums it
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        assert isinstance(res[0], EncodingFault), res[0]
        assert "the sum of chunk 4 (elements 4096..5120) overflowed" in str(res[0])
        assert isinstance(res[1], PeerAborted), res[1]  # it never got a result to apply
