"""Property-based fuzzing of every gRPC handler (issue 6; DESIGN.md invariants 4 and 5).

Real servers on loopback: two coordinators that formed membership generation 1 and a
lane server that offers a state and holds a sent chunk. Hypothesis sends each handler
(a) well-typed messages whose fields are random (edge numbers, long and unicode
strings, unknown sites, wrong generations, steps and ranks, random payloads, dtypes,
shapes and repeated fields), most of them a valid request with a field or two
changed, so the accepting path runs too, (b) raw bytes: random, or a valid message
truncated, spliced or bit-flipped, so malformed protobuf reaches the server, and for
PushChunks random sequences of chunks with duplicates and stale generations.

Properties, for every input: the call ends within its deadline; the status is never
UNKNOWN or INTERNAL (an exception escaping a handler, or grpcio's own answer to bytes
that do not parse); a refused call (any status but OK) changes no state the handler
could touch, and a read-only handler changes none at all; a well-formed answer; and
the servers answer a valid request afterwards. Each test counts its inputs; the
module prints the total (at least 10,000).
"""

from __future__ import annotations

import math
import time
import zlib

import grpc
import pytest
import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_failover import register

from isthmus.inter import lane as lane_module
from isthmus.inter.coordinator import MAX_MESSAGE_BYTES, Coordinator
from isthmus.inter.lane import LaneServer, channel_options
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import lane_pb2

pytestmark = pytest.mark.timeout(300)

FP = {"job.seed": "0"}
SITES = ["site0", "site1"]
DEADLINE_S = 5.0  # every call; a handler that takes longer is hung
WAIT_CAP_MS = 60  # long polls are asked to wait at most this long
SETTINGS = dict(
    derandomize=True,  # the same inputs on every run (CI)
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one set of servers per test, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
COUNTS: dict[str, int] = {}
BAD = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)


def count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def report_counts(request):
    yield
    total = sum(COUNTS.values())
    if not total:
        return
    line = f"fuzz: {total} inputs: " + ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


# -- generic strategies from the protobuf descriptors -----------------------------------

U64 = [0, 1, 2, 3, 7, 2**31 - 1, 2**32 - 1, 2**32, 2**40, 2**40 + 1, 2**63 - 1, 2**63, 2**64 - 1]
U32 = [0, 1, 2, 3, 7, 255, 2**16, 2**31 - 1, 2**32 - 1]
UTF8 = st.characters(codec="utf-8")
LONG = st.builds(
    lambda s, n: s * n,
    st.sampled_from(["x", "é", "名", "🙂", "site1"]),
    st.sampled_from([65, 1000, 5000, 20_000]),
)
SHORT = st.one_of(
    st.text(UTF8, max_size=24),
    st.sampled_from(["", "site0", "site1", "site2", "SITE1", " site1", "site1\x00", "raw"]),
)
TEXT = st.integers(0, 4).flatmap(lambda i: LONG if i == 0 else SHORT)  # long now and then


def scalar(field) -> st.SearchStrategy:
    t = field.type
    if t == FD.TYPE_UINT64:
        return st.one_of(st.sampled_from(U64), st.integers(0, 2**64 - 1))
    if t == FD.TYPE_UINT32:
        return st.one_of(st.sampled_from(U32), st.integers(0, 2**32 - 1))
    if t in (FD.TYPE_INT32, FD.TYPE_ENUM):
        known = [v.number for v in field.enum_type.values] if t == FD.TYPE_ENUM else [0]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    if t == FD.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return TEXT
    if t == FD.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.integers(0, 70_000).map(bytes))
    raise NotImplementedError(field.full_name)


def is_map(field) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def field_values(field, depth: int) -> st.SearchStrategy:
    """Random values for one field: a scalar, a message, a list or a map."""
    if is_map(field):
        key, value = (
            field.message_type.fields_by_name["key"],
            field.message_type.fields_by_name["value"],
        )
        return st.dictionaries(scalar(key), scalar(value), max_size=6)
    one = (
        any_message(field.message_type, depth + 1)
        if field.type == FD.TYPE_MESSAGE
        else scalar(field)
    )
    if field.is_repeated and field.type == FD.TYPE_MESSAGE:
        return st.lists(one, max_size=4)
    if field.is_repeated:
        return st.one_of(st.lists(one, max_size=4), st.lists(one, min_size=50, max_size=200))
    return one


def set_field(msg, field, value) -> None:
    msg.ClearField(field.name)
    target = getattr(msg, field.name)
    if is_map(field):
        target.update(value)
    elif field.is_repeated:
        target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def any_message(descriptor, depth: int = 0) -> st.SearchStrategy:
    """A message of `descriptor` with every field random (or unset)."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 2:
        return st.just(cls())
    fields = {f.name: st.one_of(st.none(), field_values(f, depth)) for f in descriptor.fields}

    def build(values):
        msg = cls()
        for name, value in values.items():
            if value is not None:
                set_field(msg, descriptor.fields_by_name[name], value)
        return msg

    return st.fixed_dictionaries(fields).map(build)


@st.composite
def near(draw, valid: st.SearchStrategy, changes: int = 2):
    """A valid message with up to `changes` fields replaced by random values."""
    msg = draw(valid)
    fields = list(msg.DESCRIPTOR.fields)
    for field in draw(st.lists(st.sampled_from(fields), max_size=changes, unique=True)):
        set_field(msg, field, draw(field_values(field, 1)))
    return msg


def requests(valid: st.SearchStrategy, descriptor) -> st.SearchStrategy:
    """Mostly near-valid requests (some valid), some entirely random ones."""
    return st.one_of(near(valid), near(valid, 1), any_message(descriptor))


def capped(msg):
    """Long polls wait at most WAIT_CAP_MS, so a slow answer means a hang."""
    if "wait_ms" in msg.DESCRIPTOR.fields_by_name:
        msg.wait_ms = msg.wait_ms % (WAIT_CAP_MS + 1)
    return msg


# -- valid requests against the fixture (two sites, one rank each, generation 1) --------

SMALL = st.integers(0, 3)
STEP = st.integers(0, 40)
LANES = st.lists(st.sampled_from(["127.0.0.1:2000", "[::1]:9", "h:1"]), min_size=1, max_size=1)


def site_info(name):
    return st.builds(
        lambda n, lanes, addr: pb.SiteInfo(
            name=n, index=SITES.index(n), lane_addresses=lanes, coordinator_address=addr
        ),
        name,
        LANES,
        st.sampled_from(["127.0.0.1:1", ""]),
    )


FINGERPRINT = st.just(pb.JobFingerprint(fields=FP))
DIGEST = st.one_of(st.just(""), st.binary(min_size=32, max_size=32).map(bytes.hex))
VALID = {
    "RegisterRank": st.builds(
        pb.RegisterRankRequest,
        site=st.sampled_from(SITES),
        rank=st.just(0),
        world_size=st.just(1),
        lane_address=st.sampled_from(["127.0.0.1:2000", "127.0.0.1:2001", "x"]),
        fingerprint=FINGERPRINT,
    ),
    "Join": st.builds(
        pb.JoinRequest,
        site=site_info(st.sampled_from(SITES)),
        fingerprint=FINGERPRINT,
        ready=st.booleans(),
        generation=SMALL,
    ),
    "GetMembership": st.builds(
        pb.GetMembershipRequest, known_generation=SMALL, wait_ms=st.integers(0, 5)
    ),
    "Heartbeat": st.builds(
        pb.HeartbeatRequest,
        site=st.sampled_from(SITES),
        step=STEP,
        digest=DIGEST,
        digest_step=STEP,
        finished=st.booleans(),
        generation=SMALL,
    ),
    "ReportProgress": st.builds(
        pb.ReportProgressRequest,
        site=st.sampled_from(SITES),
        step=STEP,
        loss=st.floats(0, 10),
        step_s=st.floats(0, 10),
        compute_s=st.floats(0, 10),
        cross_site_s=st.floats(0, 10),
        tokens=st.integers(0, 10**6),
        cross_site_bytes=st.integers(0, 10**9),
        raw_bytes=st.integers(0, 10**9),
        mfu=st.floats(0, 1),
        digest=DIGEST,
        digest_step=STEP,
        finished=st.booleans(),
        sync_busy_s=st.floats(0, 10),
    ),
    "CommitStep": st.builds(
        pb.CommitStepRequest,
        site=st.sampled_from(SITES),
        rank=st.just(0),
        step=STEP,
        generation=SMALL,
        ok=st.booleans(),
        wait_ms=st.integers(0, 3),
    ),
    "SiteVote": st.builds(
        pb.SiteVoteRequest,
        site=st.sampled_from(SITES),
        step=STEP,
        generation=SMALL,
        ok=st.booleans(),
        wait_ms=st.integers(0, 3),
        suspects=st.lists(st.sampled_from(SITES), max_size=2),
    ),
    "Propose": st.builds(
        lambda leader, generation, start, source, lanes: pb.ProposeRequest(
            leader=leader,
            generation=generation,
            # Every member, so an accepted proposal keeps the fixture's two sites
            # talking; other member lists come from the random changes.
            sites=[pb.SiteInfo(name=n, index=i, lane_addresses=lanes) for i, n in enumerate(SITES)],
            start_step=start,
            state_source=source,
        ),
        st.sampled_from(SITES),
        st.integers(0, 6),
        STEP,
        st.sampled_from(["", *SITES]),
        LANES,
    ),
}
REQUEST_TYPES = {
    "RegisterRank": pb.RegisterRankRequest,
    "Join": pb.JoinRequest,
    "GetMembership": pb.GetMembershipRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "ReportProgress": pb.ReportProgressRequest,
    "CommitStep": pb.CommitStepRequest,
    "SiteVote": pb.SiteVoteRequest,
    "Propose": pb.ProposeRequest,
}
REPLY_TYPES = {
    "RegisterRank": pb.RegisterRankResponse,
    "Join": pb.JoinResponse,
    "GetMembership": pb.GetMembershipResponse,
    "Heartbeat": pb.HeartbeatResponse,
    "ReportProgress": pb.ReportProgressResponse,
    "CommitStep": pb.Decision,
    "SiteVote": pb.Decision,
    "Propose": pb.ProposeResponse,
}
LOCAL = {"ReportProgress", "CommitStep"}  # fuzzed at site0 only (see test_report_progress)
READ_ONLY = {"GetMembership", "ResendChunk", "PullState"}


# -- the servers -----------------------------------------------------------------------


class Sites:
    """Two coordinators at generation 1, with one channel per coordinator."""

    def __init__(self) -> None:
        self.coords = [
            Coordinator(
                site=name,
                site_names=SITES,
                ranks=1,
                fingerprint=FP,
                join_timeout_s=20,
                heartbeat_s=0.2,
                # Nobody is suspected while the fuzzer keeps the machine busy: a
                # suspect would make the leader reconfigure the job under the test.
                failure_timeout_s=60,
                rpc_timeout_s=2,
            )
            for name in SITES
        ]
        for c in self.coords:
            c.set_peers({o.site: o.address for o in self.coords if o is not c})
            c.start()
        for i, c in enumerate(self.coords):
            register(c, lane=f"127.0.0.1:{2000 + i}")
        for c in self.coords:
            c.wait_ready(20)
        self.channels = [grpc.insecure_channel(c.address) for c in self.coords]

    def call(self, target: int, method: str, data: bytes):
        """(status, reply bytes or details, seconds) of one call with a deadline."""
        rpc = self.channels[target].unary_unary(f"/isthmus.v1.Coordinator/{method}")
        start = time.monotonic()
        try:
            reply = rpc(data, timeout=DEADLINE_S)
            return grpc.StatusCode.OK, reply, time.monotonic() - start
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), time.monotonic() - start

    def state(self, target: int):
        return coordinator_state(self.coords[target])

    def assert_healthy(self) -> None:
        for c, channel in zip(self.coords, self.channels, strict=True):
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="isthmus.v1.Coordinator"), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            status, reply, _ = self.call(
                self.coords.index(c), "GetMembership", pb.GetMembershipRequest().SerializeToString()
            )
            assert status == grpc.StatusCode.OK, reply
            membership = pb.GetMembershipResponse.FromString(reply)
            assert membership.generation >= 1 and c.error is None
            assert [s.name for s in membership.sites] == SITES

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for c in self.coords:
            c.leave()
        for c in self.coords:
            c.stop(grace_s=0.2)


def coordinator_state(c: Coordinator):
    """Everything a coordinator handler may change (not last_seen/peer_steps: the
    peers' heartbeats keep writing those)."""
    f = c.failover
    with c._cond:
        return {
            "generation": c._generation,
            "members": list(c.members),
            "lanes": list(c._lanes),
            "ready_sites": {n: i.SerializeToString() for n, i in c._ready_sites.items()},
            "joining": (c.joining, c.excluded, c._error, c.start_step, c.state_source),
            "progress": (c.step, c.finished, c._digest, sorted(c.finished_peers)),
            "rank_votes": {k: dict(v) for k, v in f._rank_votes.items()},
            "site_votes": {k: dict(v) for k, v in f._site_votes.items()},
            "decisions": {k: d.SerializeToString() for k, d in f._decisions.items()},
            "joiners": {n: i.SerializeToString() for n, i in f._joiners.items()},
            "failover": (sorted(f.restarted), f.committed_steps, f._rejoin_decision),
            "replicas": (c.replicas.latest(), c.replicas.divergence),
            "metrics": [
                c.metrics.registry.get_sample_value(name, {"site": c.site})
                for name in (
                    "isthmus_step",
                    "isthmus_tokens_total",
                    "isthmus_cross_site_wait_seconds_total",
                )
            ],
        }


@pytest.fixture
def sites():
    s = Sites()
    yield s
    try:
        s.assert_healthy()
    finally:
        s.close()


def clear_refusal(method: str, status, details: str, oversized: bool) -> None:
    """A refusal says what was wrong in a few lines. gRPC drops details above 16 KiB
    and answers RESOURCE_EXHAUSTED instead, which only an oversized request may get."""
    assert status != grpc.StatusCode.RESOURCE_EXHAUSTED or oversized, f"{method}: {details}"
    assert details and len(details) < 2048, f"{method}: unclear refusal {str(details)[:300]!r}"


def check_coordinator(sites: Sites, target: int, method: str, data: bytes) -> None:
    """The properties of one coordinator call (see the module docstring)."""
    before = sites.state(target)
    status, reply, took = sites.call(target, method, data)
    assert status not in BAD, f"{method}: {status.name}: {str(reply)[:300]}"
    assert took < DEADLINE_S
    if status == grpc.StatusCode.OK:
        REPLY_TYPES[method].FromString(reply)  # a well-formed answer
    else:
        clear_refusal(method, status, reply, len(data) > MAX_MESSAGE_BYTES)
    if status != grpc.StatusCode.OK or method in READ_ONLY:
        assert sites.state(target) == before, (
            f"{method} refused ({status.name}: {reply}) yet changed state"
        )


def typed_test(method: str, examples: int, targets=(0, 1)):
    """A hypothesis test sending `method` typed requests at the coordinators in `targets`."""

    @settings(max_examples=examples, **SETTINGS)
    @given(
        request=requests(VALID[method], REQUEST_TYPES[method].DESCRIPTOR).map(capped),
        target=st.sampled_from(targets),
    )
    def test(sites, request, target):
        count(method)
        check_coordinator(sites, target, method, request.SerializeToString())

    return test


test_register_rank = typed_test("RegisterRank", 700)
test_join = typed_test("Join", 800)
test_get_membership = typed_test("GetMembership", 400)
test_heartbeat = typed_test("Heartbeat", 800)
# At site0 only (LOCAL): an accepted digest at site1 reaches site0 with site1's next
# heartbeat, and an accepted vote at site1 is forwarded to site0; either would change
# site0 in the background while a later example runs there.
test_report_progress = typed_test("ReportProgress", 800, targets=(0,))
test_commit_step = typed_test("CommitStep", 800, targets=(0,))
test_site_vote = typed_test("SiteVote", 800)
test_propose = typed_test("Propose", 800)


# -- raw bytes ---------------------------------------------------------------------------


@st.composite
def mangled(draw, valid: st.SearchStrategy):
    """A valid message's bytes truncated, spliced with random bytes or bit-flipped."""
    data = bytearray(draw(valid).SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(["cut", "insert", "flip"]))
        if how == "cut":
            del data[at:]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            data[min(at, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


def raw_bytes(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.binary(max_size=256), mangled(valid))


def too_much(request_type, data: bytes) -> bool:
    """True when `data` parses as a long poll that asks to wait past the cap, or as a
    proposal of a new generation (test_propose covers those: one here would have the
    rank votes of earlier examples decided in the background)."""
    try:
        request = request_type.FromString(data)
    except Exception:
        return False
    if isinstance(request, pb.ProposeRequest):
        return request.generation > 1
    return getattr(request, "wait_ms", 0) > WAIT_CAP_MS


@settings(max_examples=2400, **SETTINGS)
@given(data=st.data(), method=st.sampled_from(sorted(VALID)))
def test_raw_bytes_to_every_coordinator_handler(sites, data, method):
    # All at site0: mangled bytes of a valid ReportProgress or CommitStep may still
    # be accepted there, and what they change reaches site1 in the background.
    payload = data.draw(raw_bytes(VALID[method]), label="bytes")
    assume(not too_much(REQUEST_TYPES[method], payload))
    count("raw Coordinator")
    check_coordinator(sites, 0, method, payload)


# -- the lane ------------------------------------------------------------------------------

LANE_GEN = 3
CHUNK_BYTES = 1024  # 256 fp32 elements a chunk
PER = CHUNK_BYTES // 4
LANE_LIMIT = dict(channel_options(CHUNK_BYTES))["grpc.max_receive_message_length"]
FLOOR = 2  # chunks of steps below this belong to finished rounds


def offered_state():
    return {
        "model/w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "optim/step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
    }


class Lane:
    def __init__(self) -> None:
        self.server = LaneServer(
            site_index=0, num_sites=3, codec="raw", generation=LANE_GEN, chunk_bytes=CHUNK_BYTES
        )
        self.server.offer_wait_s = 0.05
        self.server.offers.offer(LANE_GEN, 11, offered_state())
        self.sent = chunk(step=5, kind=lane_pb2.CHUNK_KIND_RESULT, from_site=0, payload=b"abc")
        self.server.outbox.put((5, 0, lane_pb2.CHUNK_KIND_RESULT, 0), self.sent, {1, 2})
        self.server.mailbox.discard_before(FLOOR)
        self.channel = grpc.insecure_channel(self.server.address)

    def rpc(self, method: str, kind: str = "unary_unary"):
        return getattr(self.channel, kind)(f"/isthmus.v1.Lane/{method}")

    def state(self):
        s, m = self.server, self.server.mailbox
        with m._cond:
            mailbox = (
                {k: id(v) for k, v in m._items.items()},
                set(m._seen),
                set(m._corrupt),
                m._floor,
            )
        with s.offers._cond:
            offer = s.offers._offer and (s.offers._offer[:2], id(s.offers._offer[2]))
        return mailbox, len(s.outbox), s.corruptions, offer, s.generation, s.site_index

    def assert_healthy(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="isthmus.v1.Lane"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = lane_pb2.ResendChunkRequest(
            generation=LANE_GEN, step=5, kind=lane_pb2.CHUNK_KIND_RESULT, from_site=1
        )
        reply = lane_pb2.ResendChunkResponse.FromString(
            self.rpc("ResendChunk")(request.SerializeToString(), timeout=5)
        )
        assert reply.chunk == self.sent
        pieces = list(
            self.rpc("PullState", "unary_stream")(
                lane_pb2.PullStateRequest(generation=LANE_GEN, step=11).SerializeToString(),
                timeout=5,
            )
        )
        assert len(pieces) == 3

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=0.2)


@pytest.fixture
def lane(monkeypatch):
    # A chunk of a newer generation waits for the lane to move to it (10 s in
    # production); the lane here never moves, so keep that wait short.
    monkeypatch.setattr(lane_module, "_GENERATION_WAIT_S", 0.05)
    server = Lane()
    yield server
    try:
        server.assert_healthy()
    finally:
        server.close()


def chunk(**fields) -> lane_pb2.PushChunksRequest:
    values = dict(
        generation=LANE_GEN,
        step=FLOOR,
        group=0,
        kind=lane_pb2.CHUNK_KIND_CONTRIBUTION,
        chunk_index=0,
        num_chunks=1,
        from_site=1,
        total_elements=PER,
        num_elements=PER,
        codec="raw",
        payload=b"",
    )
    values.update(fields)
    values.setdefault("crc32", zlib.crc32(values["payload"]))
    return lane_pb2.PushChunksRequest(**values)


@st.composite
def valid_chunk(draw):
    total = draw(st.integers(1, 4 * PER))
    num_chunks = -(-total // PER)
    index = draw(st.integers(0, num_chunks - 1))
    payload = draw(st.binary(max_size=64))
    return chunk(
        generation=LANE_GEN,
        step=draw(st.integers(0, 60)),
        group=draw(st.integers(0, 3)),
        kind=draw(st.sampled_from([lane_pb2.CHUNK_KIND_CONTRIBUTION, lane_pb2.CHUNK_KIND_RESULT])),
        chunk_index=index,
        num_chunks=num_chunks,
        from_site=draw(st.sampled_from([1, 2])),
        total_elements=total,
        num_elements=draw(st.integers(1, min(PER, total))),
        payload=payload,
        # Now and then a payload that fails its crc32: marked corrupt, pulled again.
        crc32=zlib.crc32(payload) ^ draw(st.sampled_from([0] * 6 + [1])),
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
    with the lane's own validation and a copy of its mailbox's replay guard."""
    m = lane.server.mailbox
    with m._cond:
        seen, floor = set(m._seen), m._floor
    added, corrupt = [], []
    for req in chunks:
        why = lane.server.check(req)
        key = (req.step, req.group, req.kind, req.chunk_index, req.from_site)
        if (
            (why is not None and not why.startswith("crc32 mismatch"))
            or key[0] < floor
            or key in seen
        ):
            return added, corrupt, False
        seen.add(key)
        (added if why is None else corrupt).append(key)
    return added, corrupt, True


@settings(max_examples=1000, **SETTINGS)
@given(chunks=chunk_streams())
def test_push_chunks_streams(lane, chunks):
    count("PushChunks")
    added, corrupt, ok = expected_push(lane, chunks)
    (items, seen, marked, _), outbox, corruptions, offer, *_ = lane.state()
    start = time.monotonic()
    try:
        reply = lane_pb2.PushChunksResponse.FromString(
            lane.rpc("PushChunks", "stream_unary")(
                iter([c.SerializeToString() for c in chunks]), timeout=DEADLINE_S
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
        assert (reply.accepted, reply.corrupt) == (len(added), len(corrupt))
    # Chunks before a refused one were deposited (a round's stream deposits as it
    # goes); the refused chunk and everything after it changed nothing.
    (items2, seen2, marked2, _), outbox2, corruptions2, offer2, *_ = lane.state()
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
        reply_type = lane_pb2.StatePiece if method == "PullState" else lane_pb2.ResendChunkResponse
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
VALID_PULL = st.builds(
    lane_pb2.PullStateRequest,
    generation=st.integers(LANE_GEN - 1, LANE_GEN + 1),
    step=st.integers(10, 12),
    rank=st.integers(0, 1),
)


@settings(max_examples=600, **SETTINGS)
@given(request=requests(VALID_RESEND, lane_pb2.ResendChunkRequest.DESCRIPTOR))
def test_resend_chunk(lane, request):
    count("ResendChunk")
    check_lane(lane, "ResendChunk", request.SerializeToString(), "unary_unary")


@settings(max_examples=400, **SETTINGS)
@given(request=requests(VALID_PULL, lane_pb2.PullStateRequest.DESCRIPTOR))
def test_pull_state(lane, request):
    count("PullState")
    check_lane(lane, "PullState", request.SerializeToString(), "unary_stream")


@settings(max_examples=700, **SETTINGS)
@given(data=st.data(), method=st.sampled_from(["PushChunks", "ResendChunk", "PullState"]))
def test_raw_bytes_to_every_lane_handler(lane, data, method):
    count("raw Lane")
    if method == "PushChunks":
        messages = data.draw(st.lists(raw_bytes(valid_chunk()), min_size=1, max_size=4))
        before = lane.state()
        try:
            lane.rpc("PushChunks", "stream_unary")(iter(messages), timeout=DEADLINE_S)
            return  # every message parsed into a chunk the lane took: fine
        except grpc.RpcError as exc:
            assert exc.code() not in BAD, f"{exc.code().name}: {exc.details()}"
            oversized = any(len(m) > LANE_LIMIT for m in messages)
            clear_refusal("PushChunks", exc.code(), exc.details(), oversized)
            if all(_unparsable(m) for m in messages[:1]):
                assert lane.state() == before
        return
    valid = VALID_RESEND if method == "ResendChunk" else VALID_PULL
    payload = data.draw(raw_bytes(valid))
    check_lane(lane, method, payload, "unary_stream" if method == "PullState" else "unary_unary")


def _unparsable(data: bytes) -> bool:
    try:
        lane_pb2.PushChunksRequest.FromString(data)
    except Exception:
        return True
    return False


# -- regressions: one plain test for each bug the fuzzer found ------------------------------


def test_bytes_that_do_not_parse_get_invalid_argument_naming_the_message(sites, lane):
    """Found by the fuzzer: grpcio answered INTERNAL "Exception deserializing request!"
    (inter/malformed.py now refuses them, wired into the coordinator and the lane)."""
    before = sites.state(0)
    status, details, _ = sites.call(0, "Join", b"\x0a\x05ab")  # a string cut short
    assert status == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed isthmus.v1.JoinRequest" in details
    assert sites.state(0) == before
    # A request stream: the chunk before the malformed message was taken, none after.
    good = chunk(step=7).SerializeToString()
    later = chunk(step=8).SerializeToString()
    with pytest.raises(grpc.RpcError) as refused:
        lane.rpc("PushChunks", "stream_unary")(iter([good, b"\xff\xff", later]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed isthmus.v1.PushChunksRequest" in refused.value.details()
    waiting = lane.server.mailbox.keys()
    assert {key[0] for key in waiting} == {7}
    with pytest.raises(grpc.RpcError) as refused:
        list(lane.rpc("PullState", "unary_stream")(b"\x08", timeout=5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_report_progress_refuses_negative_or_non_finite_times(sites):
    """Found by the fuzzer: a negative cross_site_s made the Prometheus counter raise
    (UNKNOWN) after some gauges were already set."""
    for field in ("step_s", "compute_s", "cross_site_s", "sync_busy_s", "mfu"):
        for value in (-1.0, math.nan, math.inf):
            request = pb.ReportProgressRequest(site="site0", step=3, **{field: value})
            before = sites.state(0)
            status, details, _ = sites.call(0, "ReportProgress", request.SerializeToString())
            assert status == grpc.StatusCode.INVALID_ARGUMENT
            assert field in details
            assert sites.state(0) == before
    # A NaN loss is still reported: a diverging run must be seen.
    ok = pb.ReportProgressRequest(site="site0", step=3, loss=math.nan, step_s=1.0)
    assert sites.call(0, "ReportProgress", ok.SerializeToString())[0] == grpc.StatusCode.OK


HUGE = "x" * 20_000  # refusal details above 16 KiB never reach the caller


@pytest.mark.parametrize(
    "method, message",
    [
        ("RegisterRank", pb.RegisterRankRequest(fingerprint=pb.JobFingerprint(fields={"k": HUGE}))),
        (
            "Join",
            pb.JoinRequest(
                site=pb.SiteInfo(name="site1", index=1),
                fingerprint=pb.JobFingerprint(fields={HUGE: "1"}),
            ),
        ),
        ("SiteVote", pb.SiteVoteRequest(site="site1", step=1, generation=1, suspects=[HUGE])),
        (
            "Propose",
            pb.ProposeRequest(leader="site1", generation=9, sites=[pb.SiteInfo(name=HUGE)]),
        ),
    ],
)
def test_a_refusal_quotes_huge_fields_briefly(sites, method, message):
    """Found by the fuzzer: refusals quoted whole fields (fingerprint keys and values,
    suspects, member names), and a refusal above 16 KiB reached the caller as
    RESOURCE_EXHAUSTED "Stream removed" instead of the reason."""
    before = sites.state(0)
    status, details, _ = sites.call(0, method, message.SerializeToString())
    assert status in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert len(details) < 500, details
    assert sites.state(0) == before


def test_a_chunk_with_a_huge_codec_name_is_refused_briefly(lane):
    """Found by the fuzzer: the lane quoted the whole codec name (see above)."""
    before = lane.state()
    with pytest.raises(grpc.RpcError) as refused:
        lane.rpc("PushChunks", "stream_unary")(
            iter([chunk(codec=HUGE).SerializeToString()]), timeout=5
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "codec 'xxxx" in refused.value.details() and len(refused.value.details()) < 500
    assert lane.state() == before


def test_an_oversized_message_is_refused_by_size_and_changes_nothing(sites, lane):
    before = sites.state(0)
    request = pb.HeartbeatRequest(site="site1", digest="x" * (MAX_MESSAGE_BYTES + 1))
    assert sites.call(0, "Heartbeat", request.SerializeToString())[0] == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert sites.state(0) == before
    before = lane.state()
    with pytest.raises(grpc.RpcError) as refused:
        lane.rpc("PushChunks", "stream_unary")(
            iter([chunk(payload=bytes(LANE_LIMIT + 1)).SerializeToString()]), timeout=5
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert lane.state() == before


def test_a_long_poll_asking_for_longer_than_the_cap_is_still_refused_at_once(sites):
    """Validation comes before any wait: an invalid vote with the longest wait."""
    request = pb.CommitStepRequest(site="site9", rank=0, step=1, generation=1, wait_ms=2**32 - 1)
    status, _, took = sites.call(0, "CommitStep", request.SerializeToString())
    assert status == grpc.StatusCode.INVALID_ARGUMENT and took < 1.0
