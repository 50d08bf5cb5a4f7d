"""A lane whose codec threads are lost mid-round: the round fails within its deadline
with a line that says so, the lane gets new threads, and the step's next round runs on
them to identical bits (issue 32: "a lane ... that dies is noticed, reported in one
line, and replaced"). Two sites with real lanes and bulk sockets on loopback."""

from __future__ import annotations

import threading

import pytest
from lanes import inputs, lane_pair, run_all, same_bits

from isthmus.inter.data.codecs.int8 import Int8Stage
from isthmus.inter.data.round.context import CrossSiteError


class _HangsWhenArmed(Int8Stage):
    """int8 whose next encode, once armed, blocks until released: a codec thread stuck
    for good (a GPU wait that never returns, a deadlocked library)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.release, self.hung = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )

    def encode(self, chunk, key=None, decoded_out=None, host=True):
        if self.armed.is_set():
            self.armed.clear()
            self.hung.set()
            self.release.wait(60)
        return super().encode(chunk, key, decoded_out=decoded_out, host=host)


def _round(ars, data, step):
    return run_all([lambda s=s: ars[s].allreduce(data[s], step, 0, True) for s in range(2)])


def _heals(ars, step):
    data = inputs(2, [40_000], seed=step)
    want = (data[0][0] + data[1][0]) / 2
    res = _round(ars, data, step)
    assert not any(isinstance(r, BaseException) for r in res), res
    assert same_bits(data[0][0], data[1][0])
    assert (data[0][0] - want).abs().max() <= 4 * want.abs().max() / 127  # int8 steps


@pytest.mark.timeout(60)
def test_a_codec_thread_that_hangs_fails_its_round_and_the_retry_gets_new_threads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with lane_pair(2, "int8", timeout_s=3.0, chunk_bytes=16 * 1024) as ars:
        stage = _HangsWhenArmed()
        ars[0].codec.tensor = stage
        _heals(ars, 1)
        old = ars[0].pool
        stage.armed.set()
        try:
            res = _round(ars, inputs(2, [40_000], seed=2), 2)
            assert stage.hung.is_set()
            assert all(isinstance(r, CrossSiteError) for r in res), res
            assert ars[0].pool is not old, "the stuck threads' pool was kept"
            assert "stuck in the failed round" in caplog.text
            # Where: the task, then its thread's innermost frames (the hung encode's wait).
            assert "contribute: wait (threading.py:" in caplog.text, caplog.text
            assert "encode (test_lane_pool.py:" in caplog.text, caplog.text
            _heals(ars, 3)  # the retry of the step, on new threads
        finally:
            stage.release.set()


@pytest.mark.timeout(60)
def test_a_pool_shut_down_under_the_lane_fails_one_round_then_heals() -> None:
    with lane_pair(2, "int8", timeout_s=3.0, chunk_bytes=16 * 1024) as ars:
        _heals(ars, 1)
        ars[0].pool.shutdown(wait=True)
        res = _round(ars, inputs(2, [40_000], seed=2), 2)
        assert isinstance(res[0], CrossSiteError), res
        assert "codec threads are gone" in str(res[0])
        assert isinstance(res[1], CrossSiteError), res  # told at once, or timed out
        _heals(ars, 3)


@pytest.mark.timeout(60)
def test_threads_lost_under_two_groups_fail_both_rounds_at_once_then_heal() -> None:
    """The chaos `lane-threads` fault (deploy/rank/faults.py): the pool is shut down
    after the step's first tasks, its queued tasks cancelled, while two groups' rounds
    use it. Both rounds fail in one line at both sites long before the 20 s deadline (a
    task cancelled in its queue once held the other group's round to its deadline), and
    the step's retry runs on one new pool."""
    import time

    from isthmus.deploy.rank.faults import PoolLostMidRound

    with lane_pair(2, "int8", timeout_s=20.0, chunk_bytes=16 * 1024) as ars:
        _heals(ars, 1)
        ars[1].pool = PoolLostMidRound(ars[1].workers, step=2)
        lost = ars[1].pool
        data = inputs(2, [200_000, 200_000], seed=2)
        started = time.monotonic()

        def site(s: int) -> list[object]:
            def group(g: int) -> object:
                try:
                    return ars[s].allreduce([data[s][g]], 2, g, True)
                except CrossSiteError as exc:
                    ars[s].membership.abort.set(f"group {g} failed")  # as LaneGradientSync does
                    return exc

            return run_all([lambda g=g: group(g) for g in range(2)])

        res = run_all([lambda s=s: site(s) for s in range(2)], timeout=40)
        assert time.monotonic() - started < 8.0, "a round waited out its deadline"
        assert all(isinstance(r, CrossSiteError) for both in res for r in both), res
        assert any("codec threads are gone" in str(r) for r in res[1]), res[1]
        assert ars[1].pool is not lost
        for ar in ars:
            ar.membership.abort.clear()
        _heals(ars, 3)
