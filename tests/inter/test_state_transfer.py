"""Training state between sites over a real lane: named tensors in checked pieces."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from isthmus.inter.data.lane import LaneServer
from isthmus.inter.data.round_types import Members
from isthmus.inter.data.state_transfer import (
    PIECE_BYTES,
    StateTransferError,
    assemble,
    pieces,
    pull_state,
)
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


@pytest.fixture
def lane():
    server = LaneServer(site_index=0, num_sites=2, codec="raw", generation=3)
    server.rank = 1
    server.offer_wait_s = 0.5
    yield server
    server.stop(grace=0)


def test_a_joining_rank_pulls_the_offered_state_over_grpc(lane):
    state = sample_state()
    with grpc.insecure_channel(lane.address) as channel:
        stub = lane_pb2_grpc.LaneStub(channel)
        # The pull may come before the offer: it waits for it.
        threading.Timer(0.2, lane.offers.offer, args=(3, 11, state)).start()
        got = pull_state(stub, generation=3, step=11, rank=1, timeout_s=10)
    assert_same(got, state)


def test_a_pull_ahead_of_the_serving_lanes_generation_waits_for_it_to_move_there(lane):
    """An outer round voted ahead: the commit admitting the joiner is decided before the
    source lands it and moves to the new generation (then offers its state)."""
    state = sample_state()

    def land() -> None:
        lane.set_members(Members(4, 0, 2))
        lane.offers.offer(4, 11, state)

    with grpc.insecure_channel(lane.address) as channel:
        stub = lane_pb2_grpc.LaneStub(channel)
        threading.Timer(0.5, land).start()
        got = pull_state(stub, generation=4, step=11, rank=1, timeout_s=10)
        assert_same(got, state)
        # A source that never gets there: the pull gives up at its deadline, saying why.
        started = time.monotonic()
        with pytest.raises(StateTransferError, match="in generation 4, not yet 5: ask again"):
            pull_state(stub, generation=5, step=11, rank=1, timeout_s=1.0)
        assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    "generation, step, rank, why",
    [
        (2, 11, 1, "generation 2 != 3"),
        (3, 11, 0, "pull from your own mesh coordinate"),
        (3, 10, 1, "offers no state after step 10"),
    ],
)
def test_a_pull_for_another_generation_rank_or_step_is_refused(lane, generation, step, rank, why):
    lane.offers.offer(3, 11, sample_state())
    with grpc.insecure_channel(lane.address) as channel:
        stub = lane_pb2_grpc.LaneStub(channel)
        with pytest.raises(StateTransferError, match=why):
            pull_state(stub, generation=generation, step=step, rank=rank, timeout_s=10)
