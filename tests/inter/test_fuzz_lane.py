"""Property-based fuzzing of the lane's handlers: PushChunks streams, ResendChunk and
PullState against a real LaneServer on loopback (see tests/inter/test_fuzz.py for the
properties; the shared pieces are in tests/fuzzing.py)."""

from __future__ import annotations

import time

import grpc
import pytest
from fuzzing import (
    BAD,
    DEADLINE_S,
    FLOOR,
    HUGE,
    LANE_GEN,
    LANE_LIMIT,
    PER,
    SETTINGS,
    Lane,
    any_message,
    chunk,
    clear_refusal,
    count,
    near,
    raw_bytes,
    requests,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from isthmus.inter.data.codecs.chain import crc32
from isthmus.inter.data.lane.mailbox import MAX_STEPS_AHEAD
from isthmus.inter.data.lane.server import LaneServer
from isthmus.proto import lane_pb2

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("report_counts")]


@st.composite
def valid_chunk(draw):
    total = draw(st.integers(1, 4 * PER))
    num_chunks = -(-total // PER)
    index = draw(st.integers(0, num_chunks - 1))
    payload = draw(st.binary(max_size=64))
    return chunk(
        generation=LANE_GEN,
        # Around the live window: stale, live, and a step or two past the last taken.
        step=draw(st.integers(max(0, FLOOR - 2), FLOOR + MAX_STEPS_AHEAD + 1)),
        group=draw(st.integers(0, 3)),
        kind=draw(st.sampled_from([lane_pb2.CHUNK_KIND_CONTRIBUTION, lane_pb2.CHUNK_KIND_RESULT])),
        chunk_index=index,
        num_chunks=num_chunks,
        from_site=draw(st.sampled_from([1, 2])),
        total_elements=total,
        num_elements=draw(st.integers(1, min(PER, total))),
        payload=payload,
        # Now and then a payload that fails its crc32: marked corrupt, pulled again.
        crc32=crc32(payload) ^ draw(st.sampled_from([0] * 6 + [1])),
    )


CHUNK_FIELDS = lane_pb2.PushChunksRequest.DESCRIPTOR


@st.composite
def chunk_streams(draw):
    """1-6 chunks, each valid, near-valid or random, with duplicates and stale ones."""
    out: list[lane_pb2.PushChunksRequest] = []
    for _ in range(draw(st.integers(1, 6))):
        pick = draw(st.sampled_from(["valid", "valid", "near", "near", "random", "again", "stale"]))
        if pick == "again" and out:
            out.append(draw(st.sampled_from(out)))  # a duplicate
            continue
        msg = draw(valid_chunk())
        if pick == "near":
            msg = draw(near(st.just(msg), 1))
        elif pick == "random":
            msg = draw(any_message(CHUNK_FIELDS))
        elif pick == "stale":
            msg.generation = draw(st.integers(0, LANE_GEN - 1))
        out.append(msg)
    return out


def expected_push(lane: Lane, chunks):
    """What the lane should do with `chunks`, chunk by chunk: the oracle checks each
    with the lane's own validation and a copy of its mailbox's replay guard (an exact
    copy of a chunk seen, by its declared crc32, is acknowledged and not stored; other
    bytes under a seen key are refused) and step window (its byte budget is unbounded
    here). Returns the keys added, marked corrupt, acknowledged again, and whether the
    stream is accepted."""
    m = lane.server.mailbox
    _, seen, _, floor, live = m.snapshot()
    added, corrupt, again = [], [], []
    for req in chunks:
        why = lane.server.check(req)
        key = (req.step, req.group, req.kind, req.chunk_index, req.from_site)
        if (
            (why is not None and not why.startswith("crc32 mismatch"))
            or req.from_site != 1  # the stream's pass was granted to site 1 only
            or key[0] < floor
            or (live and key[0] >= floor + m.max_ahead)  # too far past the live step
            or seen.get(key, req.crc32) != req.crc32
        ):
            return added, corrupt, again, False
        if key in seen:
            again.append(key)
            continue
        seen[key] = req.crc32
        (added if why is None else corrupt).append(key)
    return added, corrupt, again, True


@settings(max_examples=1000, **SETTINGS)
@given(chunks=chunk_streams())
def test_push_chunks_streams(fuzz_lane, chunks):
    count("PushChunks")
    added, corrupt, again, ok = expected_push(fuzz_lane, chunks)
    (items, seen, marked, _), outbox, corruptions, offer, *_ = fuzz_lane.state()
    start = time.monotonic()
    try:
        reply = lane_pb2.PushChunksResponse.FromString(
            fuzz_lane.rpc("PushChunks", "stream_unary")(
                iter([c.SerializeToString() for c in chunks]),
                timeout=DEADLINE_S,
                metadata=fuzz_lane.site1_pass(),
            )
        )
        status = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        status, reply = exc.code(), exc.details()
    assert status not in BAD, f"{status.name}: {reply}"
    assert time.monotonic() - start < DEADLINE_S
    if status != grpc.StatusCode.OK:
        clear_refusal("PushChunks", status, reply, any(c.ByteSize() > LANE_LIMIT for c in chunks))
    assert (status == grpc.StatusCode.OK) == ok, f"{status.name}: {reply}"
    if ok:
        assert (reply.accepted, reply.corrupt) == (len(added) + len(again), len(corrupt))
    # Chunks before a refused one were deposited (a round's stream deposits as it
    # goes); the refused chunk and everything after it changed nothing.
    (items2, seen2, marked2, _), outbox2, corruptions2, offer2, *_ = fuzz_lane.state()
    assert seen2 == seen | set(added) | set(corrupt)
    assert set(items2) == set(items) | set(added) | set(corrupt)
    assert marked2 == marked | set(corrupt)
    assert corruptions2 == corruptions + len(corrupt)
    assert (outbox2, offer2) == (outbox, offer)


def check_lane(lane: Lane, method: str, data: bytes, kind: str) -> None:
    before = lane.state()
    start = time.monotonic()
    try:
        reply = lane.rpc(method, kind)(data, timeout=DEADLINE_S)
        replies = list(reply) if kind == "unary_stream" else [reply]
        status = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        status, replies = exc.code(), exc.details()
    assert status not in BAD, f"{method}: {status.name}: {replies}"
    assert time.monotonic() - start < DEADLINE_S
    if status == grpc.StatusCode.OK:
        reply_type = {
            "PullState": lane_pb2.StatePiece,
            "OpenBulk": lane_pb2.OpenBulkResponse,
            "AbortRound": lane_pb2.AbortRoundResponse,
            "DeliverChunk": lane_pb2.DeliverChunkResponse,
            "GrantBulk": lane_pb2.GrantBulkResponse,
            "ConfirmPull": lane_pb2.ConfirmPullResponse,
        }.get(method, lane_pb2.ResendChunkResponse)
        for r in replies:
            reply_type.FromString(r)
    else:
        clear_refusal(method, status, replies, len(data) > LANE_LIMIT)
    assert lane.state() == before, f"{method} ({status.name}) changed the lane's state"


VALID_RESEND = st.builds(
    lane_pb2.ResendChunkRequest,
    generation=st.integers(LANE_GEN - 1, LANE_GEN + 1),
    step=st.integers(4, 6),
    group=st.integers(0, 1),
    kind=st.sampled_from([1, 2]),
    chunk_index=st.integers(0, 1),
    from_site=st.integers(0, 3),
)
VALID_ABORT = st.builds(
    lane_pb2.AbortRoundRequest,
    generation=st.integers(LANE_GEN - 1, LANE_GEN + 1),
    step=st.integers(0, 8),
    group=st.integers(0, 1),
    from_site=st.integers(0, 3),
    reason=st.text(max_size=40),
)
# Hand-offs answer a nonce the lane's own round made; none of these is one, so each
# must be refused and leave the mailbox, the outbox and the offer as they were.
VALID_DELIVER = st.builds(
    lane_pb2.DeliverChunkRequest, chunk=valid_chunk(), nonce=st.binary(max_size=40)
)
VALID_GRANT = st.builds(
    lane_pb2.GrantBulkRequest,
    nonce=st.binary(max_size=40),
    ticket=st.binary(max_size=40),
    port=st.integers(0, 65535),
    from_site=st.integers(0, 3),
)
# The lane made no pull's nonce: every check of one is refused (PERMISSION_DENIED).
VALID_CONFIRM = st.builds(
    lane_pb2.ConfirmPullRequest,
    nonce=st.binary(max_size=40),
    generation=st.integers(LANE_GEN - 1, LANE_GEN + 1),
    step=st.integers(10, 12),
    rank=st.integers(0, 1),
    source=st.sampled_from(["site0", "site1", ""]),
)
# The offer is for site1's rank 0, whose lane confirms none of these nonces: each pull
# must be refused, and hold nothing once it is.
VALID_PULL = st.builds(
    lane_pb2.PullStateRequest,
    generation=st.integers(LANE_GEN - 1, LANE_GEN + 1),
    step=st.integers(10, 12),
    rank=st.integers(0, 1),
    site=st.sampled_from(["site1", "site2", ""]),
    from_rank=st.integers(0, 1),
    nonce=st.binary(min_size=31, max_size=33),
)


def fuzzed_call(method: str, valid, request_type, examples: int, kind: str = "unary_unary"):
    """The test of one unary lane handler: near-valid and random ``request_type``
    messages around ``valid``, each checked by check_lane."""

    @settings(max_examples=examples, **SETTINGS)
    @given(request=requests(valid, request_type.DESCRIPTOR))
    def test(fuzz_lane, request):
        count(method)
        check_lane(fuzz_lane, method, request.SerializeToString(), kind)

    return test


test_resend_chunk = fuzzed_call("ResendChunk", VALID_RESEND, lane_pb2.ResendChunkRequest, 600)
# A given-up round is only noted (for the lane's own round, never run here): the chunks,
# outbox and offer stay as they were, and a refusal says why in a line.
test_abort_round = fuzzed_call("AbortRound", VALID_ABORT, lane_pb2.AbortRoundRequest, 300)
test_deliver_chunk = fuzzed_call("DeliverChunk", VALID_DELIVER, lane_pb2.DeliverChunkRequest, 200)
test_grant_bulk = fuzzed_call("GrantBulk", VALID_GRANT, lane_pb2.GrantBulkRequest, 200)
test_pull_state = fuzzed_call(
    "PullState", VALID_PULL, lane_pb2.PullStateRequest, 400, kind="unary_stream"
)
test_confirm_pull = fuzzed_call("ConfirmPull", VALID_CONFIRM, lane_pb2.ConfirmPullRequest, 200)


@settings(max_examples=700, **SETTINGS)
@given(
    data=st.data(),
    method=st.sampled_from(
        [
            "PushChunks",
            "ResendChunk",
            "PullState",
            "OpenBulk",
            "AbortRound",
            "DeliverChunk",
            "GrantBulk",
            "ConfirmPull",
        ]
    ),  # fmt: skip
)
def test_raw_bytes_to_every_lane_handler(fuzz_lane, data, method):
    count("raw Lane")
    if method == "PushChunks":
        messages = data.draw(st.lists(raw_bytes(valid_chunk()), min_size=1, max_size=4))
        before = fuzz_lane.state()
        try:
            fuzz_lane.rpc("PushChunks", "stream_unary")(iter(messages), timeout=DEADLINE_S)
            return  # every message parsed into a chunk the lane took: fine
        except grpc.RpcError as exc:
            assert exc.code() not in BAD, f"{exc.code().name}: {exc.details()}"
            oversized = any(len(m) > LANE_LIMIT for m in messages)
            clear_refusal("PushChunks", exc.code(), exc.details(), oversized)
            if all(_unparsable(m) for m in messages[:1]):
                assert fuzz_lane.state() == before
        return
    valid = {
        "ResendChunk": VALID_RESEND,
        "AbortRound": VALID_ABORT,
        "DeliverChunk": VALID_DELIVER,
        "GrantBulk": VALID_GRANT,
        "PullState": VALID_PULL,
        "ConfirmPull": VALID_CONFIRM,
        "OpenBulk": st.just(lane_pb2.OpenBulkRequest()),  # a ticket, never a state change
    }[method]
    payload = data.draw(raw_bytes(valid))
    check_lane(
        fuzz_lane, method, payload, "unary_stream" if method == "PullState" else "unary_unary"
    )


def _unparsable(data: bytes) -> bool:
    try:
        lane_pb2.PushChunksRequest.FromString(data)
    except Exception:
        return True
    return False


def test_a_chunk_with_a_huge_codec_name_is_refused_briefly(fuzz_lane):
    """Found by the fuzzer: the lane quoted the whole codec name (see above)."""
    before = fuzz_lane.state()
    with pytest.raises(grpc.RpcError) as refused:
        fuzz_lane.rpc("PushChunks", "stream_unary")(
            iter([chunk(codec=HUGE).SerializeToString()]),
            timeout=5,
            metadata=fuzz_lane.site1_pass(),
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "codec 'xxxx" in refused.value.details() and len(refused.value.details()) < 500
    assert fuzz_lane.state() == before


def test_streams_nobody_ends_never_take_the_threads_of_resends_and_health():
    """Issue 14, row 7: 40 never-ending PushChunks streams froze a job. A lane lets all
    but RESERVED_THREADS handler threads hold streams; past that a stream is refused at
    once, and ResendChunk and health checks are still answered."""
    from threading import Event

    from isthmus.inter.data.lane.server import PASS_METADATA, RESERVED_THREADS
    from isthmus.proto import lane_pb2_grpc

    server = LaneServer(site_index=0, num_sites=2, codec="raw", max_workers=RESERVED_THREADS + 2)
    release = Event()

    def never_ending():
        release.wait(30)
        return
        yield  # a generator that sends nothing until released

    # A stream needs a pass (a ticket granted to a site) to hold a thread at all.
    site1 = ((PASS_METADATA, server.tickets.issue("1").hex()),)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            held = [
                stub.PushChunks.future(never_ending(), timeout=30, metadata=site1) for _ in range(2)
            ]
            deadline = time.monotonic() + 10
            while server.refusals.count == 0:
                extra = stub.PushChunks.future(never_ending(), timeout=30, metadata=site1)
                try:
                    extra.result(timeout=0.5)
                except grpc.FutureTimeoutError:
                    held.append(extra)  # not yet refused: the first two were still arriving
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert time.monotonic() < deadline, "a third stream was never refused"
            ask = lane_pb2.ResendChunkRequest(generation=0, step=0, from_site=1)
            with pytest.raises(grpc.RpcError) as answer:
                stub.ResendChunk(ask, timeout=5)
            assert answer.value.code() == grpc.StatusCode.NOT_FOUND  # answered, not stuck
            health = health_pb2_grpc.HealthStub(channel)
            check = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            release.set()
            # Which calls got the two slots is a race (an extra can reach the server
            # before one of the first two); what must hold is that exactly two streams
            # were served to their end and every other one was refused, not left hanging.
            served, refused = 0, 0
            for call in held:
                try:
                    assert call.result(timeout=10).accepted == 0
                    served += 1
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    refused += 1
            assert served == 2, (served, refused)
    finally:
        release.set()
        server.stop(0)
