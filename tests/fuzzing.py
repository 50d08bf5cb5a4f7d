"""What the fuzz tests share (tests/inter/test_fuzz.py, tests/inter/test_fuzz_lane.py):
settings, the input count, strategies built from the protobuf descriptors, raw-byte
manglers, the check that a refusal explains itself, and the lane they fuzz."""

from __future__ import annotations

import os

import grpc
import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import raw_chunk
from hypothesis import HealthCheck
from hypothesis import strategies as st

from isthmus.inter.data.lane.server import PASS_METADATA, LaneServer, channel_options
from isthmus.inter.data.state.offers import Admitted
from isthmus.proto import lane_pb2

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
HUGE = "x" * 20_000  # refusal details above 16 KiB never reach the caller
COUNTS: dict[str, int] = {}
BAD = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)


def count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


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


def clear_refusal(method: str, status, details: str, oversized: bool) -> None:
    """A refusal says what was wrong in a few lines. gRPC drops details above 16 KiB
    and answers RESOURCE_EXHAUSTED instead, which only an oversized request may get."""
    assert status != grpc.StatusCode.RESOURCE_EXHAUSTED or oversized, f"{method}: {details}"
    assert details and len(details) < 2048, f"{method}: unclear refusal {str(details)[:300]!r}"


# -- a lane to fuzz (tests/inter/conftest.py serves it as the fuzz_lane fixture) ---------

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


class AskingLane:
    """Stands for the lanes of sites 1 and 2, to which a chunk asked for again goes
    (``DeliverChunk``): it takes only the one nonce its "round" made."""

    NONCE = b"\x01" * 32
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def deliver(self, frame: bytes, nonce: bytes, timeout: float) -> None:
        if nonce != self.NONCE:
            raise _Denied()
        self.got.append(frame)


class _Denied(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self) -> str:
        return "did not ask for it"


class Lane:
    """A real LaneServer on loopback in a known state: a state on offer for PullState to
    site1's rank 0 (whose "lane" confirms one nonce, random per run, that no fuzzed pull
    carries), a sent chunk in the outbox for ResendChunk, and the mailbox past step
    FLOOR."""

    def __init__(self) -> None:
        self.server = LaneServer(
            site_index=0, num_sites=3, codec="raw", generation=LANE_GEN, chunk_bytes=CHUNK_BYTES
        )
        self.pull_nonce = os.urandom(32)

        def confirm(site: str, rank: int, request, timeout: float) -> None:
            if request.nonce != self.pull_nonce:
                raise _Denied()

        admitted = Admitted(source="site0", ranks=1, rank=0, joiners={"site1": 1}, confirm=confirm)
        self.server.offers.offer(LANE_GEN, 11, offered_state(), admitted, ttl_s=600)
        self.sent = chunk(step=5, kind=lane_pb2.CHUNK_KIND_RESULT, from_site=0, payload=b"abc")
        self.asker = AskingLane()
        self.server.outbox.put(
            (5, 0, lane_pb2.CHUNK_KIND_RESULT, 0),
            self.sent.SerializeToString(),
            {1: self.asker, 2: self.asker},
        )
        self.server.mailbox.discard_before(FLOOR)
        self.channel = grpc.insecure_channel(self.server.address)

    def site1_pass(self) -> tuple:
        """Metadata of a PushChunks pass granted to site 1 (as site 1's lane holds)."""
        return ((PASS_METADATA, self.server.tickets.issue("1").hex()),)

    def rpc(self, method: str, kind: str = "unary_unary"):
        return getattr(self.channel, kind)(f"/isthmus.v1.Lane/{method}")

    def state(self):
        s, m = self.server, self.server.mailbox
        items, seen, corrupt, floor, _ = m.snapshot()
        mailbox = ({k: id(v) for k, v in items.items()}, set(seen), corrupt, floor)
        offer = s.offers.current
        offer = offer and (offer.generation, offer.step, id(offer.state), sorted(offer.waiting))
        return mailbox, len(s.outbox), s.corruptions, offer, s.generation, s.site_index

    def assert_healthy(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="isthmus.v1.Lane"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = lane_pb2.ResendChunkRequest(
            generation=LANE_GEN,
            step=5,
            kind=lane_pb2.CHUNK_KIND_RESULT,
            from_site=1,
            nonce=AskingLane.NONCE,
        )
        reply = lane_pb2.ResendChunkResponse.FromString(
            self.rpc("ResendChunk")(request.SerializeToString(), timeout=5)
        )
        assert reply.ListFields() == []  # the chunk went to the asking site's lane
        assert self.asker.got[-1] == self.sent.SerializeToString()
        pull = lane_pb2.PullStateRequest(
            generation=LANE_GEN, step=11, site="site1", nonce=self.pull_nonce
        )
        pieces = list(self.rpc("PullState", "unary_stream")(pull.SerializeToString(), timeout=5))
        assert len(pieces) == 3  # the state is still on offer, and goes to site1 only

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=0.2)


def chunk(**fields) -> lane_pb2.PushChunksRequest:
    """A sound one-chunk contribution to the fuzz lane at step FLOOR, of an empty
    payload; fields overridable."""
    return raw_chunk(PER, **{"generation": LANE_GEN, "step": FLOOR, "payload": b"", **fields})
