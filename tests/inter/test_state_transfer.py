"""Training state between sites over a real lane: named tensors in checked pieces."""

from __future__ import annotations

import dataclasses
import os
import resource
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from helpers import wait_until

from isthmus.inter.data.lane.requests import PULL_STATE_SHARE
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.state import transfer as state_transfer
from isthmus.inter.data.state.offers import Admitted, Confirm
from isthmus.inter.data.state.transfer import (
    PIECE_BYTES,
    ExpectedState,
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


def layout_of(state: dict[str, torch.Tensor], **kw) -> ExpectedState:
    """What a joiner holding tensors like ``state``'s expects (``expected_pull``'s form)."""
    return ExpectedState(tensors={n: (tuple(t.shape), t.dtype) for n, t in state.items()}, **kw)


def cap(max_bytes: int) -> ExpectedState:
    """Any name, dtype and shape, ``max_bytes`` in all."""
    return ExpectedState(tensors={}, open_prefix="", open_bytes=max_bytes)


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
    assert_same(assemble(iter(stream), cap(1 << 30)), state)
    assert_same(assemble(iter(stream), layout_of(state)), state)


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
        assemble(iter(stream), cap(1 << 30))


def test_a_truncated_tensor_or_an_oversized_state_is_refused():
    stream = list(pieces(sample_state()))
    cut = [p for i, p in enumerate(stream) if not (p.name == "model/w" and i == 5)]
    with pytest.raises(StateTransferError, match="model/w"):
        assemble(iter(cut), cap(1 << 30))
    with pytest.raises(StateTransferError, match="larger than"):
        assemble(iter(stream), cap(1_000_000))


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
                expected=layout_of(sample_state()),
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
    # At its 1 s deadline: half the 10 s a pull given the default deadline would take (one
    # ignoring it asks until the test's timeout), leaving a loaded machine 4 s of slack.
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


def piece(name: str, shape: list[int], data: bytes, dtype: str = "float32") -> lane_pb2.StatePiece:
    """One piece as a source may forge it: ``data`` the first bytes of a tensor of
    ``shape``, its fields consistent, so only what the joiner expects can refuse it."""
    size = torch.empty((), dtype=state_transfer.DTYPES[dtype]).element_size()
    total = size
    for d in shape:
        total *= d
    return lane_pb2.StatePiece(
        name=name,
        dtype=dtype,
        shape=shape,
        offset=0,
        total_bytes=total,
        data=data,
        crc32=state_transfer.crc32(data),
    )


JOINER = {
    "model/w": torch.zeros(300, 1000),
    "model/b": torch.zeros(7, dtype=torch.bfloat16),
    "rng/cpu": torch.get_rng_state(),
    "meta/next_step": torch.tensor(0, dtype=torch.int64),
}
"""What the joining rank holds: its own model, built as the source's (``expected_pull``)."""
EXPECTED = layout_of(JOINER, open_prefix="extra/", open_bytes=1 << 16)

FORGED = {
    # Issue 63: one 4-byte piece claiming shape [2**32] made the joiner allocate 16 GiB.
    "a 4-byte piece claiming 16 GiB": (
        [piece("model/w", [1 << 32], b"\0" * 4)],
        "model/w: claimed float32 [4294967296] (17179869184 bytes), "
        "expected float32 [300, 1000] (1200000 bytes)",
    ),
    "a name the joiner does not hold": (
        [piece("model/evil", [1 << 28], b"\0" * 4)],
        "'model/evil' claimed (1073741824 bytes): this rank holds no such tensor",
    ),
    "another dtype of the same size": (
        [piece("model/b", [7], b"\0" * 14, dtype="float16")],
        "model/b: claimed float16 [7] (14 bytes), expected bfloat16 [7] (14 bytes)",
    ),
    "open entries past their allowance": (
        [piece("extra/codec/g0/c0", [1 << 14], b"\0" * (1 << 16))]
        + [piece("extra/codec/g0/c1", [8], b"\0" * 32)],
        "extra/codec/g0/c1: 32 bytes take the entries under 'extra/' to 65568, beyond the "
        "65536 this rank allows them",
    ),
    "a total past the joiner's whole state": (
        [piece("extra/pad", [1 << 28], b"\0" * 4)],
        "extra/pad: a tensor of 1073741824 bytes claimed, larger than the "
        f"{EXPECTED.max_total_bytes} bytes of this rank's whole state",
    ),
}


class ForgingLane(lane_pb2_grpc.LaneServicer):
    """A live site's lane that answers a pull with forged pieces."""

    def __init__(self, stream: list[lane_pb2.StatePiece]) -> None:
        self.stream = stream

    def PullState(self, request, context):  # noqa: N802 (gRPC's name)
        yield from self.stream


@pytest.fixture
def allocations(monkeypatch) -> list[int]:
    """The bytes of each tensor the joiner allocates while pulling; one of more than
    64 MiB fails the test before it is made (without the check before allocation,
    the forged pieces here would take GiBs)."""
    made: list[int] = []

    class Recorded(state_transfer.Assembly):
        def __init__(self, p: lane_pb2.StatePiece) -> None:
            made.append(p.total_bytes)
            assert p.total_bytes <= 64 << 20, f"allocated {p.total_bytes} bytes for {p.name}"
            super().__init__(p)

    monkeypatch.setattr(state_transfer, "Assembly", Recorded)
    return made


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_piece_is_refused_before_the_joiner_allocates_it(case, allocations):
    """Issue 63: the source, not the joiner, set the joiner's memory (a cap of 1 TiB).
    Now each piece is checked against what the joiner itself holds, before its tensor
    is allocated: over a real gRPC stream on loopback, a forged piece is refused in one
    line naming it, what it claimed and what was expected."""
    stream, why = FORGED[case]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    lane_pb2_grpc.add_LaneServicer_to_server(ForgingLane(stream), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
            pytest.raises(StateTransferError) as refused,
        ):
            pull_state(
                lane_pb2_grpc.LaneStub(channel),
                generation=3,
                step=11,
                rank=1,
                site="site1",
                from_rank=1,
                nonce=os.urandom(32),
                timeout_s=10.0,
                expected=EXPECTED,
            )
    finally:
        server.stop(grace=0)
    message = str(refused.value)
    assert message.startswith("refused the state after step 11 from rank 1: "), message
    assert why in message and "\n" not in message, message
    assert sum(allocations) <= 1 << 16, allocations  # at most the open entries' allowance
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown < 256 << 10, f"the joiner's peak memory grew by {grown} KiB"


def test_a_source_of_another_size_is_held_to_its_own_shard(allocations):
    """A source whose rows differ (a site of another size) is checked against the shape
    the joiner computed for that source shard, not its own."""
    state = {"model/w": torch.ones(150, 1000), "meta/next_step": torch.tensor(4)}
    expected = layout_of(state)
    assert_same(assemble(iter(list(pieces(state))), expected), state)
    with pytest.raises(StateTransferError, match=r"claimed float32 \[300, 1000\]"):
        assemble(iter(list(pieces(dict(state, **{"model/w": torch.ones(300, 1000)})))), expected)
    assert max(allocations) <= 150 * 1000 * 4
