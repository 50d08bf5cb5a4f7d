"""The cross-site all-reduce of CUDA tensors: decoded, summed and encoded on the GPU.

Runs where a GPU is (the GPU host; see docs/benchmarks.md for the run that passed);
the same rounds on CPU tensors are covered by test_allreduce.py. Checks that every
site ends with the same bits, that they equal the sum a CPU round of the same inputs
produces: bit for bit for raw and bf16, whose encoding is exact or a plain cast; for
int8 within one quantization step, since a CUDA chunk is quantized on its GPU, where
torch divides by the scale as a multiplication by its reciprocal.
"""

from __future__ import annotations

import pytest
import torch
from lanes import inputs, run_all, sites

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("codec", ["raw", "int8", "bf16+shuffle+zstd:1"])
@pytest.mark.parametrize("num_sites", [2, 3])
def test_cuda_rounds_match_cpu_rounds_bit_for_bit(codec: str, num_sites: int) -> None:
    results = {}
    for device in ("cpu", "cuda"):
        with sites(num_sites, codec, chunk_bytes=64 * 1024) as ars:
            out = []
            for step in range(3):  # error feedback carries across steps
                data = inputs(num_sites, [300_001], seed=step)
                tensors = [[t.to(device) for t in d] for d in data]
                res = run_all(
                    [
                        lambda s=s, t=tensors, st=step: ars[s].allreduce(t[s], st, 0, True)
                        for s in range(num_sites)
                    ]
                )
                assert not any(isinstance(r, BaseException) for r in res), res
                out.append([t[0].cpu() for t in tensors])
            results[device] = out
    for step in range(3):
        cpu, gpu = results["cpu"][step], results["cuda"][step]
        for s in range(num_sites):
            assert torch.equal(gpu[s], gpu[0]), (step, s)  # replicas identical
            if codec.startswith("int8"):
                step_size = cpu[s].abs().max() / 127  # about one quantization step
                assert (gpu[s] - cpu[s]).abs().max() <= 2 * step_size, (step, s)
            else:
                assert torch.equal(gpu[s], cpu[s]), (step, s)  # same bits as the host
