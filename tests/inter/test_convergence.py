"""Convergence: lossy codecs train the tiny preset as well as the exact one.

Two sites as threads, each with its own replica of the tiny model, its own data shard
and its own optimizer; every step their gradients go through a real cross-site
all-reduce (gRPC lanes on loopback) with the codec under test. Same seed, same
batches, same step count: bf16 and int8 with error feedback must end within 2% of
the exact (raw fp32) run's final loss, with replicas bitwise identical.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from lanes import lane_pair, run_all

from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.corpus.tokens import stdlib_corpus
from isthmus.intra.model import build_model
from isthmus.intra.model_config import preset

STEPS = 60
LAST = 5  # the final loss is the mean of the last few steps' batches (same for every run)


def _train(codec: str, corpus) -> tuple[float, list[str]]:
    losses: list[list[float]] = [[], []]
    models = [build_model(preset("tiny"), seed=0) for _ in range(2)]
    optims = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0) for m in models]
    data = [
        ShardedBatches(corpus, seq_len=64, batch_size=8, seed=0, shard_index=s, num_shards=2)
        for s in range(2)
    ]
    with lane_pair(2, codec, timeout_s=30.0, chunk_bytes=64 * 1024) as ars:

        def site(s: int) -> None:
            for step in range(STEPS):
                inputs, targets = data[s].batch(step)
                logits = models[s](inputs)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                optims[s].zero_grad(set_to_none=False)
                loss.backward()
                grads = [p.grad for p in models[s].parameters()]
                ars[s].allreduce(grads, step, 0, average=True)
                optims[s].step()
                losses[s].append(loss.item())

        res = run_all([lambda s=s: site(s) for s in range(2)], timeout=50)
        assert not any(isinstance(r, BaseException) for r in res), res
    digests = [
        hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest()
        for m in models
    ]
    final = sum(sum(site_losses[-LAST:]) for site_losses in losses) / (2 * LAST)
    return final, digests


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bf16_and_int8_with_error_feedback_converge_like_fp32() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two sites share this machine's cores
    try:
        corpus = stdlib_corpus(2 << 20)
        exact, exact_digests = _train("raw", corpus)
        assert exact_digests[0] == exact_digests[1]
        for codec in ("bf16", "int8+zstd:1"):
            final, digests = _train(codec, corpus)
            assert digests[0] == digests[1], codec  # every site applied the same update
            assert abs(final - exact) / exact < 0.02, (codec, final, exact)
    finally:
        torch.set_num_threads(threads)
