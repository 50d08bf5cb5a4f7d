"""A step whose rounds fail because a site died is retried among the survivors (a RETRY
in a new generation): three sites with real coordinators, lanes and memberships on
loopback. What a retry must hand the step: the survivors' gradients averaged over the
survivors, and a shared round (``LaneGradientSync.share``, the balancer's) summed over
them only -- the dead site adds nothing, and nothing is counted twice."""

from __future__ import annotations

import pytest
import torch
from helpers import wait_until
from lanes import inputs, run_all
from memberships import joined_sites


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dies", ["before its round", "during its round"])
def test_a_retried_step_sums_its_shared_round_over_the_surviving_sites(dies):
    with joined_sites(3, decision_timeout_s=20.0, lane_timeout_s=2.0) as (syncs, coords):
        grads = inputs(3, [60_000], seed=11)
        shared = [torch.full((3 * 1024,), 1.0) * (s + 1) for s in range(3)]
        want_grad = (grads[0][0] + grads[1][0]) / 2
        want_shared = shared[0] + shared[1]

        def step(s: int):
            syncs[s].share(4, shared[s])
            syncs[s].start(4, 0, grads[s][0])
            return syncs[s].finish(4)

        if dies == "during its round":
            # site2 sends its shard and dies while the chunks cross: what reached the
            # survivors' buffers of its data must not survive into the retry.
            syncs[2].share(4, shared[2].clone())
            syncs[2].start(4, 0, grads[2][0].clone())
            outbox = syncs[2].allreduce.server.outbox
            wait_until(lambda: len(outbox) > 0, "site2 sent a chunk of its round")
            syncs[2].allreduce.server.stop(0)
        # The survivors' rounds fail (site2's chunks stop coming, the lanes time out),
        # they vote "failed", and the leader finds site2 gone (no heartbeats) and
        # retries the step without it.
        coords[2].stop(grace_s=0)
        results = run_all([lambda s=s: step(s) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in results), results
        for s, outcome in enumerate(results):
            assert outcome.committed
            assert outcome.stats.retries >= 1  # the first try failed; a retry committed
            assert outcome.stats.sites == 2
            assert torch.equal(grads[s][0], want_grad)
            assert torch.equal(shared[s], want_shared), shared[s]
