"""Property-based fuzzing of every gRPC handler (issue 6; docs/design.md invariants 4 and 5).

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

import grpc
import pytest
from coordinators import rank_key, register
from fuzzing import (
    BAD,
    DEADLINE_S,
    FP,
    HUGE,
    LANE_LIMIT,
    SETTINGS,
    SITES,
    WAIT_CAP_MS,
    capped,
    chunk,
    clear_refusal,
    count,
    raw_bytes,
    requests,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from isthmus.inter.control.channels import MAX_MESSAGE_BYTES
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.proto import coordinator_pb2 as pb

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("report_counts")]

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
# What a CommitStep and a SiteVote both say: a site's verdict on a step.
VERDICT = dict(
    site=st.sampled_from(SITES),
    step=STEP,
    generation=SMALL,
    ok=st.booleans(),
    wait_ms=st.integers(0, 3),
)
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
    "CommitStep": st.builds(pb.CommitStepRequest, rank=st.just(0), **VERDICT),
    "SiteVote": st.builds(
        pb.SiteVoteRequest, suspects=st.lists(st.sampled_from(SITES), max_size=2), **VERDICT
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
                CoordinatorSettings(
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
    peers' heartbeats keep writing those; nor the peers' claimed digests: the peer loop
    settles a doubted claim with its site at its own heartbeat, whenever that comes)."""
    f = c.failover
    with c.state.cond:
        return {
            "generation": c.state.generation,
            "members": list(c.members),
            "lanes": list(c.state.lanes),
            "ready_sites": {n: i.SerializeToString() for n, i in c.state.ready_sites.items()},
            "joining": (c.joining, c.excluded, c.state.error, c.start_step, c.state_source),
            "progress": (c.step, c.state.finished, c.digest, sorted(c.state.finished_peers)),
            "rank_votes": {k: dict(v) for k, v in f.ballots.rank_votes.items()},
            "site_votes": {k: dict(v) for k, v in f.ballots.site_votes.items()},
            "decisions": {k: d.SerializeToString() for k, d in f.ballots.decisions.items()},
            "joiners": {n: i.SerializeToString() for n, i in f.ballots.joiners.items()},
            "failover": (sorted(c.state.restarted), c.state.committed_steps, f.ballots.rejoin),
            "replicas": (c.replicas.latest().get(c.site), c.replicas.divergence),
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


# -- regressions: one plain test for each bug the fuzzer found ------------------------------


def test_bytes_that_do_not_parse_get_invalid_argument_naming_the_message(sites, fuzz_lane):
    """Found by the fuzzer: grpcio answered INTERNAL "Exception deserializing request!"
    (inter/malformed.py now refuses them, wired into the coordinator and the lane)."""
    before = sites.state(0)
    status, details, _ = sites.call(0, "Join", b"\x0a\x05ab")  # a string cut short
    assert status == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed isthmus.v1.JoinRequest" in details
    assert sites.state(0) == before
    # A request stream: the chunk before the malformed message was taken, none after.
    live = fuzz_lane.server.mailbox.floor  # within the window of steps a lane takes
    good = chunk(step=live + 1).SerializeToString()
    later = chunk(step=live + 2).SerializeToString()
    with pytest.raises(grpc.RpcError) as refused:
        fuzz_lane.rpc("PushChunks", "stream_unary")(
            iter([good, b"\xff\xff", later]), timeout=5, metadata=fuzz_lane.site1_pass()
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed isthmus.v1.PushChunksRequest" in refused.value.details()
    waiting = fuzz_lane.server.mailbox.keys()
    assert {key[0] for key in waiting} == {live + 1}
    with pytest.raises(grpc.RpcError) as refused:
        list(fuzz_lane.rpc("PullState", "unary_stream")(b"\x08", timeout=5))
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
    ok = pb.ReportProgressRequest(
        site="site0", step=3, loss=math.nan, step_s=1.0, rank_key=rank_key(sites.coords[0])
    )
    assert sites.call(0, "ReportProgress", ok.SerializeToString())[0] == grpc.StatusCode.OK


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


def test_an_oversized_message_is_refused_by_size_and_changes_nothing(sites, fuzz_lane):
    before = sites.state(0)
    request = pb.HeartbeatRequest(site="site1", digest="x" * (MAX_MESSAGE_BYTES + 1))
    assert sites.call(0, "Heartbeat", request.SerializeToString())[0] == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert sites.state(0) == before
    before = fuzz_lane.state()
    with pytest.raises(grpc.RpcError) as refused:
        fuzz_lane.rpc("PushChunks", "stream_unary")(
            iter([chunk(payload=bytes(LANE_LIMIT + 1)).SerializeToString()]),
            timeout=5,
            metadata=fuzz_lane.site1_pass(),
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert fuzz_lane.state() == before


def test_a_long_poll_asking_for_longer_than_the_cap_is_still_refused_at_once(sites):
    """Validation comes before any wait: an invalid vote with the longest wait."""
    request = pb.CommitStepRequest(site="site9", rank=0, step=1, generation=1, wait_ms=2**32 - 1)
    status, _, took = sites.call(0, "CommitStep", request.SerializeToString())
    # A vote held first would end at the call's 5 s deadline (DEADLINE_EXCEEDED, not this
    # code), or later at the 30 s cap; half the deadline leaves a loaded machine slack.
    assert status == grpc.StatusCode.INVALID_ARGUMENT and took < DEADLINE_S / 2, (status, took)
