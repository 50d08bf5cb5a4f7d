"""The int8 codec's fused kernels (inter/data/codecs/int8_kernels.py) against its torch
code, bit for bit: the payload, the residual error feedback keeps, and the decoded
values. Run on CPU tensors under Triton's interpreter (a GPU runs the same kernels
compiled; tests/inter/test_allreduce_cuda.py checks those against the CPU rounds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the kernels are Triton's; the --dev install brings it")

_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from isthmus.inter.data.codecs import int8_kernels
    from isthmus.inter.data.codecs.int8 import Int8Stage
    from isthmus.inter.data.codecs.int8 import BLOCK

    assert int8_kernels.usable(torch.empty(1)), "the interpreter should run the kernels"

    def bits(t):
        return t.view(torch.int32)  # torch.equal holds -0.0 equal to 0.0; replicas must not

    def torch_path(stage, *args, **kwargs):
        os.environ["ISTHMUS_FUSED"] = "0"
        try:
            return stage.encode(*args, **kwargs)
        finally:
            os.environ["ISTHMUS_FUSED"] = "1"

    g = torch.Generator().manual_seed(7)
    fused, reference = Int8Stage(), Int8Stage()
    # Whole blocks and a short last one, steps that carry a residual, a block of zeros,
    # values far apart in size, and halves that round to even.
    for step, n in enumerate([3 * BLOCK, 3 * BLOCK, 2 * BLOCK + 77, 2 * BLOCK + 77, 5]):
        x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)
        x[:BLOCK] = 0.0 if step == 1 else x[:BLOCK]
        if step == 0:
            x[BLOCK : BLOCK + 8] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5, -0.5, 3.5, 4.5])
        key = f"g0/c{n}"
        out_f, out_r = torch.empty(n), torch.empty(n)
        a = bytes(fused.encode(x, key, decoded_out=out_f))
        b = bytes(torch_path(reference, x, key, decoded_out=out_r))
        assert a == b, f"step {step}: payloads differ"
        assert torch.equal(bits(out_f), bits(out_r)), f"step {step}: decoded values differ"
        assert torch.equal(bits(out_f), bits(reference.decode(b, n))), f"step {step}: not decode"
        assert torch.equal(bits(fused.state_dict()[key]), bits(reference.state_dict()[key]))
        got = int8_kernels.dequantize(torch.frombuffer(bytearray(a), dtype=torch.uint8), n,
                                      torch.empty(n))
        assert torch.equal(bits(got), bits(reference.decode(a, n))), f"step {step}: dequantize"

    # In place: the decoded values replace the sum they came from (a round's result).
    x = torch.randn(4 * BLOCK, generator=g)
    want = torch.empty_like(x)
    b = bytes(torch_path(Int8Stage(), x.clone(), "r", decoded_out=want))
    assert bytes(Int8Stage().encode(x, "r", decoded_out=x)) == b
    assert torch.equal(bits(x), bits(want))

    # Not finite: the payload says so by its scales, and the residual is dropped.
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2 * BLOCK, generator=g)
        x[BLOCK + 3] = bad
        payload = fused.encode(x, "bad")
        assert not fused.finite(payload, x.numel()), bad
        assert "bad" not in fused.state_dict(), bad
    print("ok")
    """
)


def test_fused_int8_equals_the_torch_code_bit_for_bit() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", ISTHMUS_FUSED="1")
    done = subprocess.run(
        [sys.executable, "-c", "import os\n" + _CHECK],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )


_ROUNDS = textwrap.dedent(
    """
    import os, torch
    from lanes import inputs, run_all, same_bits, lane_pair
    from isthmus.inter.data.round.pipeline import NonFiniteGradient, PeerAborted

    def rounds(fused):
        os.environ["ISTHMUS_FUSED"] = fused
        with lane_pair(2, "int8") as ars:
            out = []
            for step in range(3):  # error feedback carries across steps
                data = inputs(2, [5000], seed=step)
                res = run_all([lambda s=s: ars[s].allreduce(data[s], step, 0, True)
                               for s in range(2)])
                assert not any(isinstance(r, BaseException) for r in res), res
                out.append([d[0] for d in data])
            return out

    # A site keeps its own part of the chunks it sums with no payload made on the host
    # (the fused path); the torch path makes and checks one. Same bits either way.
    fused, torch_code = rounds("1"), rounds("0")
    for step in range(3):
        for s in range(2):
            assert same_bits(fused[step][s], fused[step][0]), (step, s)
            assert same_bits(fused[step][s], torch_code[step][s]), (step, s)

    # A non-finite value of this site's gradient is refused before anything of it
    # leaves, in a chunk the site sums (the own part, checked in the sum) and in one it
    # sends (checked on the payload's scales) alike.
    os.environ["ISTHMUS_FUSED"] = "1"
    for chunk in range(5):
        with lane_pair(2, "int8", timeout_s=5.0) as ars:
            data = inputs(2, [5000], seed=9)
            data[0][0][chunk * 1024 + 7] = float("nan") if chunk % 2 else float("inf")
            res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False)
                           for s in range(2)])
            assert isinstance(res[0], NonFiniteGradient), (chunk, res)
            assert "this site's gradient holds NaN or Inf (chunk %d" % chunk in str(res[0])
            assert isinstance(res[1], PeerAborted), (chunk, res)
    print("ok")
    """
)


def test_rounds_keep_their_own_part_on_the_fused_path_with_the_same_bits() -> None:
    """A round's own part of a chunk it sums: under the fused kernels no payload is
    copied to the host (round.py ``_contribute_own``, ``CodecChain.keep_own``); the
    results are the torch code's bit for bit, and a NaN or Inf there still stops the
    site before anything leaves (caught in the sum)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
