"""Issue 38: a finite gradient that left a site as NaN, and a refused chunk that cost its
sender the round's whole deadline.

Real lanes on loopback (and real coordinators where a step is voted on). The fault is
injected where the stream race of issue 38 struck, in the encode: a tensor stage that
encodes one chunk as if it held NaN. What must hold:

- the sender checks every encoded chunk before it leaves, and names step, group, chunk
  and codec when a finite chunk comes out non-finite (nothing is sent);
- a chunk refused twice at its receiver (a fault that got past the sender's check) fails
  the round at every site at once, not at the round's deadline, and is counted in
  ``nonfinite_chunks`` where it was refused;
- with a membership the failed step is retried and commits, replicas equal.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from lanes import inputs, lane_pair, run_all
from memberships import joined_sites

from isthmus.inter.data.lane.mailbox import MAX_ABORTS, Mailbox
from isthmus.inter.data.round.context import CrossSiteError, EncodingFault, PeerAborted
from isthmus.proto import lane_pb2, lane_pb2_grpc

# Long enough that a site waiting for the deadline fails the time checks below.
TIMEOUT_S = 30.0
AT_ONCE_S = 8.0
"""A round given up must end well inside its deadline at every site."""


class BreaksOneChunk:
    """A tensor stage that encodes the chunk under ``key`` as if it held NaN, ``times``
    times (what a race between CUDA streams did). ``hide``: also report the payload
    finite, so that it gets past the sender's check and its receiver must refuse it."""

    def __init__(self, inner, key: str, times: int = 1, hide: bool = False) -> None:
        self.inner, self.key, self.left, self.hide = inner, key, times, hide

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def encode(self, chunk: torch.Tensor, key: str | None = None):
        if key == self.key and self.left > 0:
            self.left -= 1
            return self.inner.encode(torch.full_like(chunk, float("nan")), None)
        return self.inner.encode(chunk, key)

    def finite(self, payload, num_elements: int) -> bool:
        return True if self.hide else self.inner.finite(payload, num_elements)


def _break(ar, key: str, **kwargs) -> None:
    ar.codec.tensor = BreaksOneChunk(ar.codec.tensor, key, **kwargs)


def _timed(fn):
    def run():
        t0 = time.monotonic()
        try:
            return fn(), time.monotonic() - t0
        except CrossSiteError as exc:
            return exc, time.monotonic() - t0

    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "raw", "bf16", "int4+zstd:1"])
def test_a_finite_chunk_that_encodes_to_nan_is_not_sent_and_no_site_waits(codec):
    with lane_pair(2, codec, timeout_s=TIMEOUT_S) as ars:
        # Chunk 2 of step 0 group 0 belongs to site 0: site 1 would send it there.
        _break(ars[1], "g0/c2")
        data = inputs(2, [10 * 1024], seed=3)
        results = run_all(
            [_timed(lambda s=s: ars[s].allreduce(data[s], 0, 0, True)) for s in range(2)],
            timeout=TIMEOUT_S + 10,
        )
    (err0, took0), (err1, took1) = results
    assert isinstance(err1, EncodingFault), err1
    for words in ("step 0 group 0", "chunk 2", codec.split("+")[0], "not sent"):
        assert words in str(err1), err1
    assert err1.stats is not None and err1.stats.nonfinite_chunks == 1
    # Site 0 never saw a NaN: it stopped because site 1 told it so, at once.
    assert isinstance(err0, PeerAborted), err0
    assert "site 1 gave the round up" in str(err0) and "chunk 2" in str(err0)
    assert err0.stats is not None and err0.stats.nonfinite_chunks == 0
    assert max(took0, took1) < AT_ONCE_S, (took0, took1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "raw"])
def test_a_chunk_refused_twice_fails_the_round_everywhere_at_once_and_is_counted(codec):
    with lane_pair(2, codec, timeout_s=TIMEOUT_S) as ars:
        _break(ars[1], "g0/c2", times=1, hide=True)  # sent; its resend is the same bytes
        data = inputs(2, [10 * 1024], seed=4)
        results = run_all(
            [_timed(lambda s=s: ars[s].allreduce(data[s], 0, 0, True)) for s in range(2)],
            timeout=TIMEOUT_S + 10,
        )
    (err0, took0), (err1, took1) = results
    assert isinstance(err0, CrossSiteError) and not isinstance(err0, PeerAborted), err0
    assert "site 1 sent NaN or Inf in chunk 2 twice" in str(err0)
    assert err0.stats is not None and err0.stats.nonfinite_chunks >= 1  # where refused
    assert isinstance(err1, PeerAborted), err1
    assert "site 0 gave the round up" in str(err1)
    # Before issue 38, site 1 waited out its whole deadline for chunk 2's result.
    assert max(took0, took1) < AT_ONCE_S, (took0, took1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hide", [False, True], ids=["caught-at-sender", "refused-at-receiver"])
def test_a_step_with_a_nonfinite_chunk_is_retried_at_once_and_commits(hide):
    with joined_sites(2, decision_timeout_s=20.0, lane_timeout_s=TIMEOUT_S) as (syncs, _):
        # Chunk 3 of step 3 group 0 belongs to site 0: site 1 sends it there.
        _break(syncs[1].allreduce, "g0/c3", times=1, hide=hide)
        grads = inputs(2, [10 * 1024], seed=5)
        want = (grads[0][0] + grads[1][0]) / 2

        def step(s: int):
            syncs[s].start(3, 0, grads[s][0])
            return syncs[s].finish(3)

        t0 = time.monotonic()
        outcomes = run_all([lambda s=s: step(s) for s in range(2)], timeout=TIMEOUT_S + 30)
        took = time.monotonic() - t0
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    for outcome in outcomes:
        assert outcome.committed and outcome.stats.retries == 1 and outcome.stats.sites == 2
    # Counted where the chunk was stopped: at its sender, or at the receiver that refused it.
    where = 0 if hide else 1
    assert outcomes[where].stats.nonfinite_chunks >= 1, [o.stats for o in outcomes]
    assert torch.equal(grads[0][0], grads[1][0])  # replicas identical
    assert torch.equal(grads[0][0], want)  # raw: the exact mean of the retried round
    assert took < AT_ONCE_S + 5, took  # a vote and a retry, not the lanes' 30 s deadline


def test_abort_notes_are_bounded_and_follow_the_live_steps():
    box = Mailbox(max_ahead=4)
    box.discard_before(10)  # the live step is 10
    assert box.note_abort(9, 0, 1, "old") == "stale"
    assert box.note_abort(14, 0, 1, "far ahead") == "ahead"
    assert box.note_abort(10, 3, 1, "x" * 10_000) is None
    site, why = box.aborted(10, 3)
    assert site == 1 and len(why) == 512
    assert box.note_abort(10, 3, 2, "second") is None and box.aborted(10, 3)[0] == 1
    for group in range(4, 4 + MAX_ABORTS - 1):
        assert box.note_abort(11, group, 1, "") is None
    assert box.note_abort(12, 0, 1, "") == "full"
    box.discard_before(11)  # step 10's note goes with its step
    assert box.aborted(10, 3) is None and box.aborted(11, 4) is not None
    box.clear()  # a new generation starts with none
    assert box.aborted(11, 4) is None


def test_abort_round_is_refused_for_another_generation_or_an_impossible_sender():
    with lane_pair(2, "raw", timeout_s=TIMEOUT_S) as ars:
        server = ars[0].server
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            for ask, code in [
                (dict(generation=6, from_site=1), grpc.StatusCode.FAILED_PRECONDITION),
                (dict(generation=7, from_site=0), grpc.StatusCode.INVALID_ARGUMENT),
                (dict(generation=7, from_site=5), grpc.StatusCode.INVALID_ARGUMENT),
            ]:
                with pytest.raises(grpc.RpcError) as refused:
                    stub.AbortRound(lane_pb2.AbortRoundRequest(step=0, **ask), timeout=5)
                assert refused.value.code() == code, refused.value.details()
            assert server.mailbox.aborted(0, 0) is None  # nothing noted
            stub.AbortRound(
                lane_pb2.AbortRoundRequest(generation=7, step=0, group=0, from_site=1), timeout=5
            )
            assert server.mailbox.aborted(0, 0) == (1, "")
