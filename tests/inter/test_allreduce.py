"""Cross-site all-reduce over real gRPC lanes on loopback, one thread per site."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from helpers import raw_chunk
from lanes import CHUNK, inputs, lane_pair, run_all

from isthmus.inter.data.codecs.chain import crc32, make_codec
from isthmus.inter.data.lane.mailbox import CORRUPT, Mailbox
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import PASS_METADATA, LaneServer
from isthmus.inter.data.round.allreduce import (
    CrossSiteAllReduce,
    CrossSiteError,
    FixedMembership,
)
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.sync.gradient import LaneGradientSync
from isthmus.proto import lane_pb2, lane_pb2_grpc

SIZES = [[1000, 3, 2500], [17], [1024], [5, 4096, 1]]  # incl. < one chunk, exact chunk


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_sites", [2, 3])
@pytest.mark.parametrize("codec", ["raw", "zstd:1"])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_allreduce_is_exact_and_identical(
    num_sites: int, codec: str, average: bool, transport: str
) -> None:
    with lane_pair(num_sites, codec, transport=transport) as ars:
        for step, sizes in enumerate(SIZES):
            data = inputs(num_sites, sizes, seed=step)
            # Reference in the owner's fixed site order, in float32.
            want = []
            for k in range(len(sizes)):
                acc = data[0][k].clone()
                for s in range(1, num_sites):
                    acc += data[s][k]
                want.append(acc / num_sites if average else acc)
            res = run_all(
                [
                    lambda s=s, d=data, st=step: ars[s].allreduce(d[s], st, 0, average)
                    for s in range(num_sites)
                ]
            )
            for s in range(num_sites):
                assert not isinstance(res[s], BaseException), res[s]
                for k in range(len(sizes)):
                    assert torch.equal(data[s][k], want[k]), (s, k)
            assert all(len(a.server.mailbox) == 0 for a in ars)
            total = sum(sizes) * 4
            moved = sum(r.raw_bytes for r in res)
            # Each site moves 2(S-1)/S of the buffer; chunk rounding makes it inexact.
            assert moved <= 2 * total * (num_sites - 1) + 2 * CHUNK * num_sites


@pytest.mark.timeout(30)
def test_multiple_connections_and_groups() -> None:
    with lane_pair(3, "zstd:1", connections=3) as ars:
        for group in range(3):
            data = inputs(3, [3000, 7], seed=group)
            want = [data[0][k] + data[1][k] + data[2][k] for k in range(2)]
            res = run_all(
                [lambda s=s, d=data, g=group: ars[s].allreduce(d[s], 5, g, False) for s in range(3)]
            )
            assert not any(isinstance(r, BaseException) for r in res), res
            assert all(torch.equal(data[s][k], want[k]) for s in range(3) for k in range(2))


@pytest.mark.timeout(10)
def test_single_site_is_a_no_op() -> None:
    with lane_pair(1) as (ar,):
        x = torch.arange(10.0)
        stats = ar.allreduce([x], 0, 0, average=True)
        assert torch.equal(x, torch.arange(10.0)) and stats.bytes_sent == 0


# --- the server refuses bad input and keeps its state --------------------------------


def _request(**overrides: object) -> lane_pb2.PushChunksRequest:
    return raw_chunk(**{"generation": 7, "step": 3, **overrides})


class _Site1Stub:
    """A lane stub whose PushChunks streams present a pass granted to site 1, as the
    real site 1's do (without TLS, a chunk is taken only from its site's pass)."""

    def __init__(self, server: LaneServer, channel: grpc.Channel) -> None:
        self._stub = lane_pb2_grpc.LaneStub(channel)
        self._pass = ((PASS_METADATA, server.tickets.issue("1").hex()),)

    def PushChunks(self, requests, timeout):  # noqa: N802 (gRPC method name)
        return self._stub.PushChunks(requests, timeout=timeout, metadata=self._pass)

    def __getattr__(self, name: str):
        return getattr(self._stub, name)


@pytest.fixture()
def lone_server() -> Iterator[tuple[LaneServer, _Site1Stub]]:
    server = LaneServer(site_index=0, num_sites=3, codec="raw", generation=7, chunk_bytes=CHUNK)
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, _Site1Stub(server, channel)
    finally:
        channel.close()
        server.stop(0)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("bad", "code", "words"),
    [
        (dict(generation=6), grpc.StatusCode.FAILED_PRECONDITION, "generation 6"),
        (dict(codec="zstd:1"), grpc.StatusCode.FAILED_PRECONDITION, "codec 'zstd:1'"),
        (dict(chunk_index=1), grpc.StatusCode.INVALID_ARGUMENT, "chunk_index 1 >= num_chunks 1"),
        (dict(from_site=3), grpc.StatusCode.INVALID_ARGUMENT, "from_site 3"),
        (dict(from_site=0), grpc.StatusCode.INVALID_ARGUMENT, "from_site 0"),
        (dict(kind=lane_pb2.CHUNK_KIND_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT, "kind"),
        (
            dict(num_elements=2000, total_elements=2000, num_chunks=2),
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_elements 2000",
        ),
        (dict(num_chunks=5), grpc.StatusCode.INVALID_ARGUMENT, "num_chunks 5"),
        (
            dict(payload=bytes(CHUNK * 2), crc32=crc32(bytes(CHUNK * 2))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceeds",
        ),
    ],
)
def test_server_refuses_bad_chunk(
    lone_server, bad: dict, code: grpc.StatusCode, words: str
) -> None:
    server, stub = lone_server
    good = _request(chunk_index=0)
    before = server.mailbox.keys()
    with pytest.raises(grpc.RpcError) as info:
        stub.PushChunks(iter([_request(**bad)]), timeout=5)
    assert info.value.code() == code
    assert words in info.value.details() and "site 0 refused" in info.value.details()
    assert server.mailbox.keys() == before == []
    # The server still works afterwards.
    assert stub.PushChunks(iter([good]), timeout=5).accepted == 1
    assert len(server.mailbox) == 1


@pytest.mark.timeout(20)
def test_server_marks_crc_mismatch_corrupt_and_answers_resend(lone_server) -> None:
    server, stub = lone_server
    reply = stub.PushChunks(
        iter([_request(crc32=12345), _request(chunk_index=0, step=4)]), timeout=5
    )
    assert (reply.accepted, reply.corrupt) == (1, 1)
    assert server.corruptions == 1
    key = (3, 0, lane_pb2.CHUNK_KIND_CONTRIBUTION, 0, 1)
    assert server.mailbox.take_any([key], timeout=1) == (key, CORRUPT)
    # The intact copy comes back only through redeposit, never as a second push.
    with pytest.raises(grpc.RpcError) as info:
        stub.PushChunks(iter([_request()]), timeout=5)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert server.mailbox.redeposit(key, _request()) and not server.mailbox.redeposit(
        key, _request()
    )
    assert server.mailbox.take(key, timeout=1).crc32 == _request().crc32
    # ResendChunk hands the chunk to the asker's lane, never to the caller.
    sent = _request(from_site=0)
    asker = _Asker()
    server.outbox.put((3, 0, lane_pb2.CHUNK_KIND_RESULT, 0), sent.SerializeToString(), {2: asker})
    ask = lane_pb2.ResendChunkRequest(
        generation=7,
        step=3,
        group=0,
        kind=lane_pb2.CHUNK_KIND_RESULT,
        chunk_index=0,
        from_site=2,
        nonce=b"n" * 32,
    )
    assert stub.ResendChunk(ask, timeout=5).ListFields() == []
    assert asker.got == [(sent.SerializeToString(), b"n" * 32)]
    for bad, code in (
        (dict(from_site=1), grpc.StatusCode.NOT_FOUND),
        (dict(step=2), grpc.StatusCode.NOT_FOUND),
        (dict(generation=6), grpc.StatusCode.FAILED_PRECONDITION),
    ):
        wrong = lane_pb2.ResendChunkRequest()
        wrong.CopyFrom(ask)
        for name, value in bad.items():
            setattr(wrong, name, value)
        with pytest.raises(grpc.RpcError) as info:
            stub.ResendChunk(wrong, timeout=5)
        assert info.value.code() == code


class _Asker:
    """Stands for the asking site's lane: takes what is handed to it."""

    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.got: list[tuple[bytes, bytes]] = []

    def deliver(self, frame: bytes, nonce: bytes, timeout: float) -> None:
        self.got.append((frame, nonce))


def _other_payload() -> lane_pb2.PushChunksRequest:
    """The same chunk key as ``_request()``, with other (sound) bytes."""
    other = _request()
    other.payload = np.full(10, 2.0, np.float32).tobytes()
    other.crc32 = crc32(other.payload)
    return other


@pytest.mark.timeout(20)
def test_server_stores_a_chunk_once_and_refuses_another_payload_and_stale(lone_server) -> None:
    server, stub = lone_server
    key = (3, 0, lane_pb2.CHUNK_KIND_CONTRIBUTION, 0, 1)
    assert stub.PushChunks(iter([_request()]), timeout=5).accepted == 1
    # An exact copy (what a sender sends again after a stalled connection) is
    # acknowledged and dropped: the mailbox still holds one chunk.
    assert stub.PushChunks(iter([_request()]), timeout=5).accepted == 1
    assert len(server.mailbox) == 1
    # Other bytes under a key already seen are refused: the first copy stands.
    with pytest.raises(grpc.RpcError) as info:
        stub.PushChunks(iter([_other_payload()]), timeout=5)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "duplicate" in info.value.details()
    assert len(server.mailbox) == 1
    assert server.mailbox.take(key, timeout=1).crc32 == _request().crc32
    # Taken chunks stay known: after take() a copy is not stored again, and another
    # payload is still refused.
    assert stub.PushChunks(iter([_request()]), timeout=5).accepted == 1
    with pytest.raises(grpc.RpcError):
        stub.PushChunks(iter([_other_payload()]), timeout=5)
    assert len(server.mailbox) == 0
    server.mailbox.discard_before(4)
    with pytest.raises(grpc.RpcError) as info:
        stub.PushChunks(iter([_request(step=3, group=1)]), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(server.mailbox) == 0


@pytest.mark.timeout(30)
def test_a_lane_holds_only_the_live_steps_within_its_budget() -> None:
    """Issue 14, row 8: 1,500 chunks for far-future steps were all taken and never freed."""
    one = len(_request().payload)
    server = LaneServer(
        site_index=0, num_sites=3, codec="raw", generation=7, chunk_bytes=CHUNK,
        mailbox_bytes=3 * one,
    )  # fmt: skip
    channel = grpc.insecure_channel(server.address)
    stub = _Site1Stub(server, channel)

    def push(**fields: object) -> grpc.StatusCode:
        try:
            stub.PushChunks(iter([_request(**fields)]), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    try:
        server.mailbox.discard_before(3)  # a round of step 3 is live
        ahead = 3 + server.mailbox.max_ahead
        assert push(step=ahead) == grpc.StatusCode.FAILED_PRECONDITION
        assert push(step=10**6) == grpc.StatusCode.FAILED_PRECONDITION
        # A sender three generations ahead is refused at once, not held for seconds: held,
        # it would wait up to 10 s for the generation and the push's 5 s deadline would
        # end it first (DEADLINE_EXCEEDED), so the code alone tells them apart.
        assert push(generation=10) == grpc.StatusCode.FAILED_PRECONDITION
        assert [push(step=3, group=i) for i in range(3)] == [grpc.StatusCode.OK] * 3
        # Full: refused, and nothing of it kept (the same key is taken once room is made).
        assert push(step=4) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(server.mailbox) == 3 and server.mailbox.waiting_bytes == 3 * one
        server.mailbox.take((3, 0, lane_pb2.CHUNK_KIND_CONTRIBUTION, 0, 1), timeout=1)
        assert push(step=4) == grpc.StatusCode.OK
        assert server.mailbox.waiting_bytes == 3 * one
        server.mailbox.discard_before(4)
        assert server.mailbox.waiting_bytes == one
    finally:
        channel.close()
        server.stop(0)


@pytest.mark.timeout(10)
def test_mailbox_take_times_out_and_discards() -> None:
    box = Mailbox()
    with pytest.raises(TimeoutError):
        box.take((0, 0, 1, 0, 1), timeout=0.05)
    assert box.deposit((1, 0, 1, 0, 1), _request()) is None
    assert box.deposit((2, 0, 1, 0, 1), _request()) is None
    assert box.discard_before(2) == 1
    assert box.keys() == [(2, 0, 1, 0, 1)]


# --- silent peers fail within the timeout --------------------------------------------


@pytest.mark.timeout(20)
def test_peer_that_never_runs_its_round() -> None:
    with lane_pair(2, timeout_s=1.0) as ars:
        t0 = time.monotonic()
        # Timed out waiting for site 1, or for the bulk ticket site 1 grants only once
        # its own round with site 0 has begun.
        never = r"site 0 step 0 group 0: (timed out .* \[1\]|.*no round with site 0 yet)"
        with pytest.raises(CrossSiteError, match=never):
            ars[0].allreduce([torch.ones(3000)], 0, 0, average=False)
        # Within its 1 s timeout: a loaded machine adds seconds, a timeout not applied
        # waits the default 60 s (or forever). 10 s keeps both apart.
        assert time.monotonic() - t0 < 10.0


@pytest.mark.timeout(20)
def test_peer_that_never_answers_tcp() -> None:
    # A listening socket that never speaks HTTP/2: connects, then silence.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    server = LaneServer(site_index=0, num_sites=2, codec="raw", chunk_bytes=CHUNK)
    peer = LanePeer(f"127.0.0.1:{hole.getsockname()[1]}", chunk_bytes=CHUNK)
    try:
        ar = CrossSiteAllReduce(
            membership=FixedMembership(server, {1: peer}),
            codec=make_codec("raw"),
            chunk_bytes=CHUNK,
            timeout_s=1.0,
        )
        t0 = time.monotonic()
        with pytest.raises(CrossSiteError, match="site 0 step 0 group 0"):
            ar.allreduce([torch.ones(5000)], 0, 0, average=False)
        # Within its 1 s timeout: a loaded machine adds seconds, a timeout not applied
        # waits the default 60 s (or forever). 10 s keeps both apart.
        assert time.monotonic() - t0 < 10.0
    finally:
        peer.close()
        server.stop(0)
        hole.close()


@pytest.mark.timeout(20)
def test_generation_mismatch_fails_fast() -> None:
    with lane_pair(2, timeout_s=5.0) as ars:
        ars[1].server.set_members(Members(8, 1, 2))
        ended: dict[int, float] = {}

        def site(s: int) -> object:
            try:
                return ars[s].allreduce([torch.ones(3000)], 0, 0, False)
            finally:
                ended[s] = time.monotonic()

        t0 = time.monotonic()
        res = run_all([lambda s=s: site(s) for s in range(2)])
        assert isinstance(res[0], CrossSiteError) and "FAILED_PRECONDITION" in str(res[0])
        assert "generation 7 != receiver's 8" in str(res[0])
        assert isinstance(res[1], CrossSiteError)
        # Site 0 is refused by the receiver, not timed out: well under half its 5 s
        # timeout, which a loaded machine does not reach and a missed refusal waits.
        assert ended[0] - t0 < 2.5, ended[0] - t0


def test_the_lane_server_holds_the_ranks_one_membership() -> None:
    """One copy of the membership on a rank: the all-reduce's rounds read the lane
    server's (through the rank's membership), so moving it there moves them, and a bad
    one is refused whole."""
    with lane_pair(2) as ars:
        ar, server = ars[0], ars[0].server
        assert ar.membership.members is server.members
        server.set_members(Members(9, 1, 2, ("b", "a")))
        view = ar.view()
        assert (view.generation, view.site_index, view.num_sites) == (9, 1, 2)
    with pytest.raises(ValueError, match=r"site_index must be in \[0, 2\), got 2"):
        Members(1, 2, 2)
    with pytest.raises(ValueError, match="1 site names for 2 sites"):
        Members(1, 0, 2, ("a",))


# --- the gradient-sync seam ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_gradient_sync_averages_groups() -> None:
    with lane_pair(2, "zstd:1") as ars:
        syncs = [LaneGradientSync(ar) for ar in ars]
        shards = inputs(2, [2100, 9], seed=3)
        want = [(shards[0][g] + shards[1][g]) / 2 for g in range(2)]

        def site(s: int) -> object:
            for g in range(2):
                syncs[s].start(11, g, shards[s][g])
            outcome = syncs[s].finish(11)
            assert outcome.committed and outcome.rejoin is None and outcome.offer_state is None
            return outcome.stats

        try:
            res = run_all([lambda s=s: site(s) for s in range(2)])
            for s in range(2):
                assert not isinstance(res[s], BaseException), res[s]
                assert res[s].step == 11 and res[s].groups == 2 and res[s].bytes_sent > 0
                assert all(torch.equal(shards[s][g], want[g]) for g in range(2))
        finally:
            for sync in syncs:
                sync.close()


@pytest.mark.timeout(30)
def test_gradient_sync_failure_leaves_shards_alone() -> None:
    with lane_pair(2, timeout_s=1.0) as ars:
        # One round at a time, so group 1's starts after group 0's failed.
        sync = LaneGradientSync(ars[0], rounds_in_flight=1)
        ran: list[int] = []
        real = ars[0].allreduce

        def counted(tensors: list[torch.Tensor], step: int, group: int, average: bool) -> object:
            ran.append(group)
            return real(tensors, step=step, group=group, average=average)

        ars[0].allreduce = counted  # type: ignore[method-assign]
        shard = torch.ones(100)
        try:
            sync.start(0, 0, shard)
            sync.start(0, 1, torch.ones(5))
            with pytest.raises(RuntimeError, match="step 1 started while step 0 is unfinished"):
                sync.start(1, 0, torch.ones(3))
            with pytest.raises(RuntimeError, match=r"finish\(1\) while step 0's rounds run"):
                sync.finish(1)
            with pytest.raises(CrossSiteError, match="step 0 group 0"):
                sync.finish(0)
            # The failed round raised the rank's one abort signal: group 1's round was
            # skipped instead of waiting out a timeout of its own.
            assert ran == [0]
            assert torch.equal(shard, torch.ones(100))
            assert not ars[0].membership.abort.is_set()  # cleared for the next step
        finally:
            sync.close()


@pytest.mark.timeout(30)
def test_a_shared_round_sums_each_sites_slot_to_the_same_bits_everywhere() -> None:
    """What the balancer relies on (deploy/batch/balance.py): a step's shared round, beside a
    gradient group, gives every site the same bits of the sum. Through int8, a value in
    a codec block of its own keeps its own scale: a slot 10^4 times smaller than
    another's crosses to within fp32 rounding instead of rounding to zero."""
    from isthmus.inter.data.codecs.int8 import BLOCK

    with lane_pair(3, "int8") as ars:
        syncs = [LaneGradientSync(ar) for ar in ars]
        slots = [0.0123, 250.5, 0.0]  # site 2 reports nothing (as a site just rejoined)
        shared = [torch.zeros(3 * BLOCK) for _ in range(3)]
        for s in range(3):
            shared[s][s * BLOCK] = slots[s]
        grads = inputs(3, [3000], seed=5)

        def site(s: int) -> object:
            syncs[s].share(4, shared[s])
            syncs[s].start(4, 0, grads[s][0])
            with pytest.raises(ValueError, match="already shared in step 4"):
                syncs[s].share(4, torch.zeros(3))
            return syncs[s].finish(4)

        try:
            res = run_all([lambda s=s: site(s) for s in range(3)])
            assert not any(isinstance(r, BaseException) for r in res), res
            assert all(torch.equal(shared[0], shared[s]) for s in (1, 2))
            assert all(torch.equal(grads[0][0], grads[s][0]) for s in (1, 2))  # averaged too
            got = shared[0][::BLOCK].tolist()
            assert got[0] == pytest.approx(slots[0], rel=1e-6)
            assert got[1] == pytest.approx(slots[1], rel=1e-6)
            assert got[2] == 0.0
            # Nothing else of the sum moved off zero.
            assert torch.count_nonzero(shared[0]) == 2
        finally:
            for sync in syncs:
                sync.close()


def test_share_takes_only_a_host_fp32_tensor() -> None:
    with lane_pair(2) as ars:
        sync = LaneGradientSync(ars[0])
        try:
            with pytest.raises(ValueError, match="CPU fp32 tensor"):
                sync.share(0, torch.zeros(4, dtype=torch.float64))
        finally:
            sync.close()
