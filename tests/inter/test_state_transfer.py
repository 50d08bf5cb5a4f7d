"""Training state between sites over a real lane: named tensors in checked pieces."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import grpc
import pytest
import torch
from helpers import wait_until

from isthmus.inter.data.lane import LaneServer
from isthmus.inter.data.lane_requests import PULL_STATE_SHARE
from isthmus.inter.data.round_types import Members
from isthmus.inter.data.state_transfer import (
    PIECE_BYTES,
    Admitted,
    Confirm,
    StateTransferError,
    assemble,
    pieces,
    pull_state,
)
from isthmus.inter.security import SiteSecurity
from isthmus.proto import lane_pb2, lane_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/w": torch.randn(300, 1000, generator=g),  # > 1 piece
        "model/b": torch.randn(7, generator=g).to(torch.bfloat16),
        "optim/w/step": torch.tensor(3.0),
        "rng/cpu": torch.get_rng_state(),
        "meta/next_step": torch.tensor(12, dtype=torch.int64),
        "extra/flag": torch.tensor([True, False]),
        "extra/empty": torch.empty(0, 4),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_pieces_reassemble_bit_for_bit():
    state = sample_state()
    stream = list(pieces(state))
    assert len([p for p in stream if p.name == "model/w"]) == -(-300 * 1000 * 4 // PIECE_BYTES)
    assert all(len(p.data) <= PIECE_BYTES for p in stream)
    assert_same(assemble(iter(stream), 1 << 30), state)


def tamper(stream, index, **fields):
    stream = [lane_pb2.StatePiece.FromString(p.SerializeToString()) for p in stream]
    for key, value in fields.items():
        if key == "shape":
            del stream[index].shape[:]
            stream[index].shape.extend(value)
        else:
            setattr(stream[index], key, value)
    return stream


@pytest.mark.parametrize(
    "change, why",
    [
        ({"crc32": 12345}, "crc32 mismatch"),
        ({"dtype": "complex64"}, "is not one of"),
        ({"shape": [3, 3]}, "bytes for shape"),
        ({"offset": 4}, "expected 0"),
        ({"name": ""}, "tensor name"),
        ({"total_bytes": 1 << 41}, "bytes for shape"),
        ({"shape": [1 << 20, 1 << 20], "total_bytes": 1 << 42}, "larger than"),
    ],
)
def test_a_malformed_piece_is_refused(change, why):
    stream = tamper(list(pieces(sample_state())), 0, **change)
    with pytest.raises(StateTransferError, match=why):
        assemble(iter(stream), 1 << 30)


def test_a_truncated_tensor_or_an_oversized_state_is_refused():
    stream = list(pieces(sample_state()))
    cut = [p for i, p in enumerate(stream) if not (p.name == "model/w" and i == 5)]
    with pytest.raises(StateTransferError, match="model/w"):
        assemble(iter(cut), 1 << 30)
    with pytest.raises(StateTransferError, match="larger than"):
        assemble(iter(stream), 1_000_000)


TOKEN = "t0ken-of-this-job-" + "x" * 16
SECURITY = SiteSecurity(require_token=True, token=TOKEN)
"""Every lane and caller here holds the job token, the forger too (issue 63)."""


def confirm_at(lanes: dict[str, list[str]]) -> Confirm:
    """Checks a pull with the asking rank's lane at ``lanes[site][rank]`` (what
    ``RankSync.offer_state`` does, through the link's proxy)."""

    def confirm(site: str, rank: int, request: lane_pb2.ConfirmPullRequest, timeout: float):
        with SECURITY.channel(lanes[site][rank]) as channel:
            lane_pb2_grpc.LaneStub(channel).ConfirmPull(request, timeout=timeout)

    return confirm


class Job:
    """site0's rank 1 (the source) offers its state; site1 (two ranks, same layout) was
    admitted in generation 3 and its rank 1 pulls it."""

    def __init__(self) -> None:
        self.source = LaneServer(
            site_index=0, num_sites=2, codec="raw", generation=3, security=SECURITY
        )
        self.source.rank = 1
        self.joiner = LaneServer(
            site_index=1, num_sites=2, codec="raw", generation=3, security=SECURITY
        )
        self.joiner.rank = 1
        self.channel = SECURITY.channel(self.source.address)
        self.stub = lane_pb2_grpc.LaneStub(self.channel)

    def admitted(self, **joiners: int) -> Admitted:
        lanes = {"site1": ["127.0.0.1:1", self.joiner.address]}
        return Admitted(
            source="site0",
            ranks=2,
            rank=1,
            joiners=joiners or {"site1": 2},
            confirm=confirm_at(lanes),
        )

    def offer(self, generation: int = 3, step: int = 11, state=None, ttl_s: float = 60.0):
        state = state if state is not None else sample_state()
        self.source.offers.offer(generation, step, state, self.admitted(), ttl_s=ttl_s)
        return state

    def pull(self, generation: int = 3, step: int = 11, rank: int = 1, timeout_s: float = 10.0):
        """What a joining rank does (``RankSync.pull_state``): a nonce from its lane, the
        pull, and the nonce forgotten."""
        nonce = self.joiner.handoff.expect_pull(generation, step, rank, "site0")
        try:
            return pull_state(
                self.stub,
                generation=generation,
                step=step,
                rank=rank,
                site="site1",
                from_rank=1,
                nonce=nonce,
                timeout_s=timeout_s,
            )
        finally:
            self.joiner.handoff.forget(nonce)

    def forged(self, **fields) -> grpc.RpcError:
        """A pull as a token holder sends it: the refusal it gets (it gets no piece)."""
        values = {"generation": 3, "step": 11, "rank": 1, "site": "site1", "from_rank": 1}
        values.update(fields)
        values.setdefault("nonce", os.urandom(32))
        with pytest.raises(grpc.RpcError) as refused:
            list(self.stub.PullState(lane_pb2.PullStateRequest(**values), timeout=5))
        return refused.value

    def close(self) -> None:
        self.channel.close()
        self.source.stop(grace=0)
        self.joiner.stop(grace=0)


@pytest.fixture
def job():
    j = Job()
    yield j
    j.close()


def test_a_joining_rank_pulls_the_offered_state_over_grpc(job):
    # The pull may come before the offer: it is told "not yet" and asks again.
    state = sample_state()
    threading.Timer(0.2, job.offer, kwargs={"state": state}).start()
    assert_same(job.pull(), state)


def test_a_pull_ahead_of_the_serving_lanes_generation_waits_for_it_to_move_there(job):
    """An outer round voted ahead: the commit admitting the joiner is decided before the
    source lands it and moves to the new generation (then offers its state)."""
    state = sample_state()

    def land() -> None:
        job.source.set_members(Members(4, 0, 2))
        job.offer(generation=4, state=state)

    threading.Timer(0.5, land).start()
    assert_same(job.pull(generation=4), state)
    # A source that never gets there: the pull gives up at its deadline, saying why.
    started = time.monotonic()
    with pytest.raises(StateTransferError, match="in generation 4, not yet 5: ask again"):
        job.pull(generation=5, timeout_s=1.0)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    "generation, step, rank, why",
    [
        (2, 11, 1, "generation 2 != 3"),
        (3, 11, 0, "pull from your own mesh coordinate"),
        (3, 10, 1, "offers no state after step 10 in generation 3 yet"),
    ],
)
def test_a_pull_for_another_generation_rank_or_step_is_refused(job, generation, step, rank, why):
    job.offer()
    with pytest.raises(StateTransferError, match=why):
        job.pull(generation=generation, step=step, rank=rank, timeout_s=1.0)


def test_the_offered_state_goes_once_to_the_admitted_rank_and_no_one_else(job, caplog):
    """Issue 63, medium: the weights, AdamW state and RNG offered at a rejoin were served
    to any token holder that asked, and still 70 steps later. Now only to the rank of
    the site the commit admitted (its own lane confirms the pull), once, then dropped."""
    job.offer()
    # In the admitted site's name: its rank's lane did not make the nonce.
    refused = job.forged()
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
    assert "the rank did not ask" in refused.details()
    # In another name, or for another rank of the site: refused before any check.
    refused = job.forged(site="site7")
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "offered to site1, not to 'site7'" in refused.details()
    refused = job.forged(from_rank=0)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pull from your own mesh coordinate" in refused.details()
    # Nor can a nonce be got confirmed by asking the joiner's lane directly.
    with SECURITY.channel(job.joiner.address) as channel, pytest.raises(grpc.RpcError) as asked:
        lane_pb2_grpc.LaneStub(channel).ConfirmPull(
            lane_pb2.ConfirmPullRequest(
                nonce=os.urandom(32), generation=3, step=11, rank=1, source="site0"
            ),
            timeout=5,
        )
    assert asked.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert job.source.refusals.count >= 3  # each one logged and counted
    # The real joining rank gets it, once; then it is gone, for it and for everyone.
    state = job.source.offers.current.state
    assert_same(job.pull(), state)
    assert job.source.offers.current is None
    refused = job.forged()
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert "no more" in refused.details()
    with pytest.raises(StateTransferError, match="no more"):
        job.pull()


def test_an_offer_nobody_pulls_is_dropped_at_its_deadline(job):
    job.offer(ttl_s=0.3)
    wait_until(lambda: job.source.offers.current is None, "the offer outlived its deadline")
    with pytest.raises(StateTransferError, match="no more"):
        job.pull()


def test_calls_in_another_sites_name_never_hold_the_admitted_sites_pull_slots(job):
    """Issue 63, medium: a token holder held both PullState slots (each call waited up to
    60 s for a state) and the real joiner's pull was refused. Now nothing waits for a
    state, a site not admitted gets no slot, and each admitted site has its own share."""
    stuck = threading.Event()
    real = job.admitted()

    def confirm(site, rank, request, timeout):
        if site == "site2":  # a site whose lane hangs: its checks hold its slots
            stuck.wait(timeout)
            raise grpc.RpcError()
        real.confirm(site, rank, request, timeout)

    admitted = dataclasses.replace(real, joiners={"site1": 2, "site2": 2}, confirm=confirm)
    state = sample_state()
    job.source.offers.offer(3, 11, state, admitted, ttl_s=60)
    request = lane_pb2.PullStateRequest(generation=3, step=11, rank=1, from_rank=1)
    try:
        held = []
        for name in ["site2"] * 10 + ["site9"] * 10:
            request.site, request.nonce = name, os.urandom(32)
            held.append(job.stub.PullState(request, timeout=30))
        # Past site2's share, and every call in a name the offer does not admit: at once.
        answered = lambda: sum(c.done() for c in held) >= 20 - PULL_STATE_SHARE  # noqa: E731
        wait_until(answered, "calls past the share were not refused at once", 5.0)
        codes = sorted(c.code().name for c in held if c.done())
        assert codes == ["PERMISSION_DENIED"] * 10 + ["RESOURCE_EXHAUSTED"] * 8, codes
        # site1's rank pulls meanwhile: site2's checks hold site2's slots only.
        assert_same(job.pull(timeout_s=5.0), state)
    finally:
        stuck.set()
        for call in held:
            call.cancel()
