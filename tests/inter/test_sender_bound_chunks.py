"""Issue 33, rows 7 and 8: without TLS, a chunk asked for again goes only to the asking
site's own lane, and a chunk is taken only from the site its ticket was granted to.

Real lanes on loopback (tests/lanes.py). The attacker is a caller on the same machine
with the lanes' addresses (a token holder, or an ``--insecure`` job): it calls
``ResendChunk`` in site 1's name (it once got 20 live gradient chunks back), asks for a
bulk ticket in site 1's name, and pushes chunks in site 1's name, NaN or finite with a
valid checksum, for the live step (each once cost the job a retried step).
"""

from __future__ import annotations

import os
import socket

import grpc
import numpy as np
import pytest
import torch
from helpers import raw_chunk
from lanes import inputs, lane_pair, run_all

from isthmus.inter.data.codecs.chain import crc32
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.transport.bulk import MAGIC, OK, REFUSED, frame_bytes
from isthmus.proto import lane_pb2, lane_pb2_grpc

pytestmark = pytest.mark.timeout(60)

_RESULT = lane_pb2.CHUNK_KIND_RESULT


def _round(ars, data, step: int) -> list:
    return run_all([lambda s=s: ars[s].allreduce(data[s], step, 0, False) for s in range(2)])


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
def test_resend_chunk_in_a_sites_name_hands_the_caller_no_bytes(transport) -> None:
    with lane_pair(2, "raw", transport=transport) as ars:
        data = inputs(2, [20 * 1024], seed=1)
        want = data[0][0] + data[1][0]
        stats = _round(ars, data, 0)
        assert all(torch.equal(d[0], want) for d in data), stats
        server = ars[0].server
        before = (server.refusals.count, ars[1].server.mailbox.keys(), len(server.outbox))
        answers = []
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            for c in range(20):  # the 20 chunks of the round, as the red team asked
                for kind in (lane_pb2.CHUNK_KIND_CONTRIBUTION, _RESULT):
                    ask = lane_pb2.ResendChunkRequest(
                        generation=7,
                        step=0,
                        group=0,
                        kind=kind,
                        chunk_index=c,
                        from_site=1,
                        nonce=os.urandom(32),
                    )
                    try:
                        answers.append(stub.ResendChunk(ask, timeout=5))
                    except grpc.RpcError as exc:
                        assert exc.code() in (
                            grpc.StatusCode.PERMISSION_DENIED,  # sent: site 1 did not ask
                            grpc.StatusCode.NOT_FOUND,  # never sent to site 1
                        ), exc.details()
        assert answers == []  # not one answer, let alone a chunk
        refused = server.refusals.count - before[0]
        assert refused == 20  # site 0 sent site 1 a contribution or a result per chunk
        # Nothing changed: site 1's mailbox, site 0's outbox.
        assert (ars[1].server.mailbox.keys(), len(server.outbox)) == before[1:]
        # And the next round runs as ever.
        data = inputs(2, [20 * 1024], seed=2)
        want = data[0][0] + data[1][0]
        assert not any(isinstance(r, BaseException) for r in _round(ars, data, 1))
        assert all(torch.equal(d[0], want) for d in data)


def _injected(kind: str, step: int, c: int, total: int) -> lane_pb2.PushChunksRequest:
    """Chunk ``c`` of a round of ``total`` elements, in site 1's name, valid checksum."""
    n = min(1024, total - c * 1024)
    values = np.full(n, np.nan if kind == "nan" else 1e3, np.float32).tobytes()
    return raw_chunk(
        generation=7,
        step=step,
        chunk_index=c,
        num_chunks=-(-total // 1024),
        total_elements=total,
        num_elements=n,
        from_site=1,
        payload=values,
        crc32=crc32(values),
    )


@pytest.mark.parametrize("transport", ["bulk", "grpc"])
@pytest.mark.parametrize("kind", ["nan", "finite"])
def test_chunks_injected_in_a_peers_name_are_refused_and_cost_no_retry(kind, transport) -> None:
    total = 10 * 1024
    with lane_pair(2, "raw", transport=transport) as ars:
        server = ars[0].server
        before = server.refusals.count
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            # Ahead of the real ones, every chunk site 0 is to receive from site 1 in
            # step 0: its contributions and its results, claimed on a PushChunks stream.
            for c in range(total // 1024):
                for chunk_kind in (lane_pb2.CHUNK_KIND_CONTRIBUTION, _RESULT):
                    forged = _injected(kind, 0, c, total)
                    forged.kind = chunk_kind
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.PushChunks(iter([forged]), timeout=5)
                    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "without a ticket or pass" in refused.value.details()
            # A bulk ticket in site 1's name: granted to site 1's lane, which did not ask.
            ask = lane_pb2.OpenBulkRequest(from_site=1, nonce=os.urandom(32))
            with pytest.raises(grpc.RpcError) as refused:
                stub.OpenBulk(ask, timeout=5)
            # Before site 0's first round it knows no lane of site 1 to grant it to.
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.mailbox.keys() == []  # nothing displaced a real chunk
        data = inputs(2, [total], seed=3)
        want = data[0][0] + data[1][0]
        results = _round(ars, data, 0)
        assert not any(isinstance(r, BaseException) for r in results), results
        assert all(torch.equal(d[0], want) for d in data)  # the exact sum
        for stats in results:  # no chunk of the round was refused, pulled or retried
            assert (stats.nonfinite_chunks, stats.corrupt_chunks) == (0, 0)
        # Now site 0 knows site 1's lane: a ticket asked in its name goes there, is
        # refused by it (it made no such nonce), and the caller gets nothing: told, as a
        # lane not met yet would be, that no lane it met asked (it may dial again).
        live = len(server.tickets.live)
        with grpc.insecure_channel(server.address) as channel:
            ask = lane_pb2.OpenBulkRequest(from_site=1, nonce=os.urandom(32))
            with pytest.raises(grpc.RpcError) as refused:
                lane_pb2_grpc.LaneStub(channel).OpenBulk(ask, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "none of the 1 lane(s) of site 1" in refused.value.details()
        assert len(server.tickets.live) == live  # the ticket it made was cancelled
        assert server.refusals.count >= before + 2 * (total // 1024) + 1
        # The next step, with injections between the rounds, is exact again.
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):
            lane_pb2_grpc.LaneStub(channel).PushChunks(
                iter([_injected(kind, 1, 0, total)]), timeout=5
            )
        data = inputs(2, [total], seed=4)
        want = data[0][0] + data[1][0]
        results = _round(ars, data, 1)
        assert not any(isinstance(r, BaseException) for r in results), results
        assert all(torch.equal(d[0], want) for d in data)


def test_a_bulk_ticket_carries_only_the_chunks_of_the_site_it_was_granted_to() -> None:
    """Three sites: site 2 holds a real ticket to site 0's bulk port; chunks it sends in
    site 1's name are refused and that connection closed; site 1's own are taken."""
    lane = LaneServer(site_index=0, num_sites=3, codec="raw", generation=1)
    try:
        with socket.create_connection(("127.0.0.1", lane.bulk_port), timeout=5) as sock:
            sock.sendall(MAGIC + lane.tickets.issue("2"))
            assert sock.recv(1) == bytes([OK])
            msg = raw_chunk(from_site=1).SerializeToString()
            sock.sendall(frame_bytes(msg))
            assert sock.recv(1) == bytes([REFUSED])
            assert b"granted to 2" in sock.recv(4096)
        assert lane.mailbox.keys() == []
        with socket.create_connection(("127.0.0.1", lane.bulk_port), timeout=5) as sock:
            sock.sendall(MAGIC + lane.tickets.issue("1"))
            assert sock.recv(1) == bytes([OK])
            sock.sendall(frame_bytes(msg))
            assert sock.recv(1) != bytes([REFUSED])
        assert lane.mailbox.keys() == [(0, 0, 1, 0, 1)]
    finally:
        lane.stop(0)
