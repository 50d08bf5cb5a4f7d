"""The all-reduce with every codec chain: exact when lossless, identical when lossy."""

from __future__ import annotations

import pytest
import torch
from lanes import inputs, lane_pair, run_all, same_bits

from isthmus.deploy.config.job import load_config
from isthmus.inter.data.sync.gradient import LaneGradientSync
from isthmus.inter.data.transport.chunk_size import CUDA_BULK_CHUNK_BYTES, chunk_bytes_for_link

pytestmark = pytest.mark.timeout(60)


def _reference(data: list[list[torch.Tensor]], k: int, average: bool) -> torch.Tensor:
    acc = data[0][k].clone()  # the owner's fixed site order
    for d in data[1:]:
        acc += d[k]
    return acc / len(data) if average else acc


@pytest.mark.parametrize("num_sites", [2, 3])
@pytest.mark.parametrize("codec", ["raw+shuffle+zstd:1", "zstd:1:2"])
def test_lossless_chains_are_exact(num_sites: int, codec: str) -> None:
    with lane_pair(num_sites, codec, connections=2) as ars:
        data = inputs(num_sites, [5000, 3], seed=1)
        want = [_reference(data, k, True) for k in range(2)]
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 2, 1, True) for s in range(num_sites)])
        assert not any(isinstance(r, BaseException) for r in res), res
        assert all(torch.equal(data[s][k], want[k]) for s in range(num_sites) for k in range(2))


@pytest.mark.parametrize("num_sites", [2, 3])
@pytest.mark.parametrize(
    "codec", ["bf16", "bf16+shuffle+zstd:1", "int8", "int8+zstd:1", "int4", "int4+zstd:1"]
)
def test_lossy_chains_give_every_site_the_same_bits(num_sites: int, codec: str) -> None:
    with lane_pair(num_sites, codec) as ars:
        for step in range(3):
            data = inputs(num_sites, [5000, 7], seed=step)
            want = [_reference(data, k, True) for k in range(2)]
            res = run_all(
                [
                    lambda s=s, d=data, st=step: ars[s].allreduce(d[s], st, 0, True)
                    for s in range(num_sites)
                ]
            )
            assert not any(isinstance(r, BaseException) for r in res), res
            for k in range(2):
                assert all(same_bits(data[s][k], data[0][k]) for s in range(num_sites))
                # Two roundings (contribution, result): a few quantization steps.
                tol = {"bf16": 0.02, "int8": 0.1, "int4": 0.5}[codec[:4]]
                err = (data[0][k] - want[k]).abs().max() / want[k].abs().max()
                assert err < tol, (codec, k, float(err))
            sent = sum(r.bytes_sent for r in res)
            raw = sum(r.raw_bytes for r in res)
            assert raw / sent > {"bf16": 1.9, "int8": 3.5, "int4": 7.0}[codec[:4]]
        # Each lane keeps its own residuals, for its contributions and owned results.
        if codec.startswith("int"):
            keys = set(ars[0].state_dict())
            assert any("/c" in k for k in keys) and any("/r" in k for k in keys)


def test_gradient_sync_exposes_codec_state() -> None:
    with lane_pair(2, "int8") as ars:
        syncs = [LaneGradientSync(ar) for ar in ars]
        shards = inputs(2, [3000], seed=3)

        def site(s: int) -> None:
            syncs[s].start(0, 0, shards[s][0])
            assert syncs[s].finish(0).committed

        try:
            res = run_all([lambda s=s: site(s) for s in range(2)])
            assert not any(isinstance(r, BaseException) for r in res), res
            assert torch.equal(shards[0][0], shards[1][0])
            state = syncs[0].state_dict()
            assert state and all(v.device.type == "cpu" for v in state.values())
            syncs[1].load_state_dict(state)
            assert syncs[1].state_dict().keys() == state.keys()
        finally:
            for sync in syncs:
                sync.close()


def test_chunk_size_follows_the_bandwidth_delay_product() -> None:
    assert chunk_bytes_for_link(1e9, 0.0001) == 256 * 1024  # 12.5 KB BDP: the floor
    assert chunk_bytes_for_link(1e9, 0.010) == 1024 * 1024  # 1.25 MB BDP
    assert chunk_bytes_for_link(10e9, 0.050) == 4 * 1024 * 1024  # 62.5 MB: the ceiling
    assert chunk_bytes_for_link(10e9, 0.050, 16 << 20) == 16 << 20  # the bulk port's
    with pytest.raises(ValueError):
        chunk_bytes_for_link(0, 0.01)


def test_cuda_chunks_on_the_bulk_port_are_larger() -> None:
    """The job's auto chunk: the link's BDP, up to 16 MiB on the bulk port and 4 MiB on
    gRPC (its message limit), at least 16 MiB for CUDA tensors on the bulk port; a
    chosen size always wins."""
    link = ["wan.distance_km=1000", "wan.bandwidth_mbit=10000"]  # BDP 12.25 MB
    cpu = load_config(overrides=[*link, "topology.device=cpu"]).chunk_bytes
    cuda = load_config(overrides=[*link, "topology.device=cuda"]).chunk_bytes
    grpc = load_config(overrides=[*link, "topology.device=cuda", "sync.transport=grpc"])
    cpu_grpc = load_config(overrides=[*link, "topology.device=cpu", "sync.transport=grpc"])
    chosen = load_config(overrides=[*link, "topology.device=cuda", "sync.chunk_bytes=65536"])
    fast = ["wan.distance_km=1000", "wan.bandwidth_mbit=25000", "topology.device=cpu"]
    assert cpu == 8 << 20
    assert load_config(overrides=fast).chunk_bytes == 16 << 20  # 30.6 MB: the ceiling
    assert cuda == CUDA_BULK_CHUNK_BYTES == 16 << 20
    assert grpc.chunk_bytes == cpu_grpc.chunk_bytes == 4 << 20
    assert chosen.chunk_bytes == 65536
