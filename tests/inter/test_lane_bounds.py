"""Issue 33: what one caller can hold at a lane is bounded, and the rest still answers.

A real LaneServer on loopback, called from outside as a stranger (or a token holder)
would. Row 3: 40 ``PullState`` calls held for a state nobody offers took every handler
thread; the job's rounds, ``OpenBulk`` and health checks froze for 50 s.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import wait_until
from lanes import CHUNK, inputs, lane_pair, run_all

from isthmus.inter.data.lane.server import (
    PASS_METADATA,
    PULL_STATE_SLOTS,
    RESERVED_THREADS,
    LaneServer,
)
from isthmus.proto import lane_pb2, lane_pb2_grpc


@pytest.mark.timeout(60)
def test_pull_states_for_a_state_nobody_offers_hold_no_thread():
    """Row 3: 40 PullState calls each waited for a state; now none waits (issue 63): a
    state not offered yet is answered "ask again" at once, and the lane answers the rest."""
    server = LaneServer(site_index=0, num_sites=2, codec="raw", generation=1)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            ask = lane_pb2.PullStateRequest(
                generation=1, step=3, rank=0, site="site1", nonce=bytes(32)
            )
            calls = [stub.PullState(ask, timeout=30) for _ in range(40)]
            wait_until(lambda: all(c.done() for c in calls), "a pull waited", 5.0)
            for call in calls:
                assert call.code() == grpc.StatusCode.UNAVAILABLE, call.details()
                assert "offers no state after step 3 in generation 1 yet" in call.details()
            assert server.pulls.free == PULL_STATE_SLOTS
            # The lane still answers what trains: a ticket, a health check, a resend.
            with pytest.raises(grpc.RpcError) as answer:  # answered: no round with site 1 yet
                stub.OpenBulk(lane_pb2.OpenBulkRequest(from_site=1, nonce=bytes(32)), timeout=5)
            assert answer.value.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="isthmus.v1.Lane"), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as answer:
                stub.ResendChunk(lane_pb2.ResendChunkRequest(generation=1, from_site=1), timeout=5)
            assert answer.value.code() == grpc.StatusCode.NOT_FOUND  # answered, not frozen
    finally:
        server.stop(0)


@pytest.mark.timeout(60)
def test_one_site_holds_only_its_share_of_the_streams():
    """Issue 33: PushChunks streams were one pool for every peer, so a caller with a
    ticket (or, with TLS, a site's certificate: `isthmus chaos --only flood` with TLS
    retried 64 steps) that held them open refused every other peer's chunks. Each peer
    site may hold its share; a stream without a pass holds nothing."""
    server = LaneServer(site_index=0, num_sites=3, codec="raw", max_workers=RESERVED_THREADS + 4)
    release = threading.Event()

    def never_ending():
        release.wait(30)
        return
        yield  # a stream that sends nothing until released

    def opened(site: str):
        metadata = ((PASS_METADATA, server.tickets.issue(site).hex()),)
        return stub.PushChunks.future(never_ending(), timeout=30, metadata=metadata)

    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            with pytest.raises(grpc.RpcError) as refused:  # no pass: turned away at once
                stub.PushChunks(never_ending(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            share = 4 // 2  # 4 stream slots, 2 peer sites
            hoarder = [opened("2") for _ in range(share)]
            deadline = time.monotonic() + 10
            while True:  # the hoarder's next stream is refused once its share arrived
                extra = opened("2")
                try:
                    extra.result(timeout=0.5)
                except grpc.FutureTimeoutError:
                    hoarder.append(extra)
                    assert time.monotonic() < deadline, "site 2 was never held to its share"
                    continue
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    assert f"site 2 holds its {share} PushChunks stream slots" in exc.details()
                    break
            peer = [opened("1") for _ in range(share)]  # the real peer still gets its share
            time.sleep(1.0)
            assert not any(call.done() for call in peer), [c.exception() for c in peer]
            release.set()
            assert all(call.result(timeout=10).accepted == 0 for call in peer)
            for call in hoarder:
                call.cancel()
    finally:
        release.set()
        server.stop(0)


@pytest.mark.timeout(30)
def test_one_chunk_calls_the_peer_has_no_slot_for_go_again_later() -> None:
    """On gRPC each chunk is a ``PushChunks`` call of its own (push_round.py), two in
    flight a connection: a lane with one stream slot refuses the calls past it
    (RESOURCE_EXHAUSTED, its threads busy), and those go again 50 ms later instead of
    failing the round."""
    with lane_pair(2, connections=3, transport="grpc", max_workers=RESERVED_THREADS + 1) as ars:
        data = inputs(2, [40 * CHUNK // 4], seed=4)  # 40 chunks, 20 each way
        want = data[0][0] + data[1][0]
        res = run_all([lambda s=s: ars[s].allreduce(data[s], 0, 0, False) for s in range(2)])
        assert not any(isinstance(r, BaseException) for r in res), res
        assert torch.equal(data[0][0], want) and torch.equal(data[1][0], want)
        busy = sum(ar.server.refusals.count for ar in ars)
        assert busy > 0  # calls were turned away (and went again)
