"""A CPU group's round buffer is reused two steps later (inter/data/sync/buffers.py).

A new buffer a step cost more than its copy (the kernel faults in and zeroes its pages:
8 groups of 256 MiB spent 1.1 of a 1.8 s step there). Reuse must not change a result,
must wait the two steps the outbox keeps a raw chunk's bytes for a peer's resend, and
must never hand out the buffer of a round that failed (its threads may still write).
"""

from __future__ import annotations

import pytest
import torch
from lanes import inputs, lane_pair, run_all, same_bits

from isthmus.inter.data.round.context import CrossSiteError
from isthmus.inter.data.sync.gradient import LaneGradientSync

pytestmark = pytest.mark.timeout(60)


def _recording(ar, seen: dict[tuple[int, int], int], fail: set[tuple[int, int]] = frozenset()):
    """Wraps ``ar.allreduce`` to note the address each (step, group) round works in."""
    real = ar.allreduce

    def allreduce(tensors, step, group, average, **kwargs):
        seen[(step, group)] = tensors[0].data_ptr()
        if (step, group) in fail:
            raise CrossSiteError(f"step {step} group {group}: failed on purpose")
        return real(tensors, step=step, group=group, average=average, **kwargs)

    ar.allreduce = allreduce


def test_a_groups_buffer_comes_back_two_steps_later_and_every_step_is_exact() -> None:
    steps, sizes = 6, [2100, 9, 4097]
    with lane_pair(2, "raw") as ars:
        syncs = [LaneGradientSync(ar, rounds_in_flight=2) for ar in ars]
        seen: list[dict[tuple[int, int], int]] = [{}, {}]
        for s in range(2):
            _recording(ars[s], seen[s])
        grads = [inputs(2, sizes, seed=step) for step in range(steps)]
        want = [[(g[0][i] + g[1][i]) / 2 for i in range(len(sizes))] for g in grads]

        def site(s: int) -> None:
            for step in range(steps):
                for group, shard in enumerate(grads[step][s]):
                    syncs[s].start(step, group, shard)
                assert syncs[s].finish(step).committed

        try:
            res = run_all([lambda s=s: site(s) for s in range(2)])
            assert res == [None, None], res
        finally:
            for sync in syncs:
                sync.close()
    for step in range(steps):
        for s in range(2):
            assert all(same_bits(grads[step][s][i], want[step][i]) for i in range(len(sizes)))
    for s in range(2):
        for group in range(len(sizes)):
            at = [seen[s][(step, group)] for step in range(steps)]
            assert at[0] != at[1]  # the previous step's bytes may still be asked for
            assert at[2:] == [at[0], at[1], at[0], at[1]], (s, group, at)


def test_a_failed_rounds_buffer_is_not_handed_out_again() -> None:
    with lane_pair(1, "raw") as ars:
        sync = LaneGradientSync(ars[0], rounds_in_flight=1)
        seen: dict[tuple[int, int], int] = {}
        _recording(ars[0], seen, fail={(0, 0)})
        try:
            for step in range(4):
                sync.start(step, 0, torch.ones(5000))
                if step == 0:
                    with pytest.raises(CrossSiteError, match="failed on purpose"):
                        sync.finish(step)
                else:
                    assert sync.finish(step).committed
        finally:
            sync.close()
    assert seen[(2, 0)] != seen[(0, 0)]  # step 0's round failed: a new buffer
    assert seen[(3, 0)] == seen[(1, 0)]  # step 1's succeeded: reused


@pytest.mark.timeout(90)
def test_a_retried_rounds_buffer_is_the_one_reused_two_steps_later() -> None:
    from memberships import joined_sites

    with joined_sites(3, decision_timeout_s=20.0, lane_timeout_s=2.0) as (syncs, coords):
        seen: list[dict[tuple[int, int], int]] = [{}, {}]
        for s in range(2):
            _recording(syncs[s].allreduce, seen[s])
        # site2 is gone before step 4's round: the survivors' first try fails, and the
        # step is retried without it, in a new buffer (the failed round's may be written).
        coords[2].stop(grace_s=0)
        syncs[2].allreduce.server.stop(0)
        grads = {step: inputs(2, [6000], seed=step) for step in (4, 5, 6)}
        tries: list[list[int]] = [[], []]

        def site(s: int) -> None:
            for step in (4, 5, 6):
                syncs[s].start(step, 0, grads[step][s][0])
                outcome = syncs[s].finish(step)
                assert outcome.committed, outcome
                if step == 4:
                    assert outcome.stats.retries >= 1
                    tries[s].append(seen[s][(4, 0)])  # the round that committed

        res = run_all([lambda s=s: site(s) for s in range(2)], timeout=80)
        assert res == [None, None], res
        for s in range(2):
            assert seen[s][(6, 0)] == tries[s][0]  # the retried round's buffer, not the failed
            want = (grads[6][0][0] + grads[6][1][0]) / 2
            assert same_bits(grads[6][s][0], want)
