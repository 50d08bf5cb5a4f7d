"""Hostile callers for the chaos suite: ``flood``, ``forge`` and ``forge-rejoin`` (issues 14, 63).

``flood`` holds health watches and long polls open at a coordinator (rows 6-7: they
once froze the job). ``forge`` is what a process on the machine that holds the job
token sends a running job: calls claiming to come from a site or a rank they do not
come from. Every one must be refused or found out, and the job finish with equal digests:

1. a heartbeat in site1's name with a digest site1 does not have (it once stopped
   site0 with "replicas differ");
2. a join in site1's name "after a restart", naming the forger's lanes (it once
   dropped the live site1 and handed the state to the caller);
3. votes for site0's rank on the coming steps without the rank's key (the first vote
   for a step won, and froze the job);
4. a proposal from site1 with the members reordered (it froze the job for good), and
   one in the leader's name in the job's order, sent to site1;
5. at site0's rank-0 lane (issue 33): ResendChunk in site1's name around the job's steps
   (row 7: it once handed out 20 live gradient chunks), OpenBulk in site1's name, and
   NaN and finite chunks with a valid checksum for the coming steps (row 8: each once
   cost a retried step). The lane refuses and logs each.

``forge_rejoin`` runs while site1 restarts (issue 63, rows 1-2): "site0 finished" in
site0's name to site1, and pulls of the state offered to site1 in its name.
"""

from __future__ import annotations

import functools
import itertools
import json
import secrets
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from isthmus.inter.security import SiteSecurity
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["flood", "forge", "forge_rejoin", "missed_forgeries", "missed_rejoin_forgeries"]


def _channel(address: str, credentials: SiteSecurity | None = None) -> grpc.Channel:
    """A channel with ``credentials`` (site0's certificate and the job token, with TLS),
    else with the user's job token, which the chaos suite's sites run with: without it
    every call is refused at the gate and nothing behind it is tested. So the caller is
    the strongest attacker that is not the site it claims to be."""
    if credentials is not None:
        return credentials.channel(address)
    from isthmus.deploy.security.token import job_token

    return SiteSecurity(token=job_token()).channel(address)


def flood(address: str, duration_s: float, credentials: SiteSecurity | None = None) -> None:
    """Holds 20 health watches and 40 long polls open at a coordinator, and 40
    PushChunks streams that send nothing at the lane of its rank 0, for a while: what
    an unauthenticated caller can do (health needs no token), as issue 14 did (rows 6-7)."""
    from isthmus.proto import lane_pb2_grpc

    stop = threading.Event()

    def nothing():  # a stream that sends no chunk until the flood ends
        stop.wait(duration_s + 5)
        yield from ()

    with _channel(address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.CoordinatorStub(channel)
        timeout = duration_s + 5
        calls = [health.Watch(health_pb2.HealthCheckRequest(), timeout=timeout) for _ in range(20)]
        membership = stub.GetMembership(pb.GetMembershipRequest(), timeout=5)
        ask = pb.GetMembershipRequest(known_generation=10**6, wait_ms=30_000)
        calls += [stub.GetMembership.future(ask, timeout=timeout) for _ in range(40)]
        mine = [info for info in membership.sites if info.coordinator_address == address]
        lane = mine[0].lane_addresses[0] if mine and mine[0].lane_addresses else None
        with _channel(lane or address, credentials) as lane_channel:
            if lane is not None:
                push = lane_pb2_grpc.LaneStub(lane_channel).PushChunks
                calls += [push.future(nothing(), timeout=timeout) for _ in range(40)]
            time.sleep(duration_s)
            stop.set()
            for call in calls:
                call.cancel()


def forge(
    target: str,
    fingerprint: Mapping[str, str],
    step: int,
    duration_s: float,
    *,
    victim: str = "site1",
    victims_coordinator: str | None = None,
    ranks: int = 1,
    credentials: SiteSecurity | None = None,
    progress: Callable[[], int] | None = None,
) -> dict[str, int]:
    """Sends the forged calls to the coordinator at ``target`` (site0's, the leader's)
    for ``duration_s``, each claiming to come from ``victim``, and to
    ``victims_coordinator`` a Propose in the leader's name in the job's own order.
    ``progress`` reads where the job is before each volley (else the forger counts a step
    a volley from ``step``, and could miss a job's every few steps' digests). Returns how
    many calls of each kind were answered without an error (those must have changed
    nothing that matters)."""
    kinds = ("heartbeat", "join", "vote", "propose", "leader's propose", "resend", "open bulk")
    answered = dict.fromkeys((*kinds, "chunk"), 0)
    deadline = time.monotonic() + duration_s
    first = step
    with (
        _channel(target, credentials) as channel,
        _channel(victims_coordinator or target, credentials) as other,
    ):
        stub, victims = pb_grpc.CoordinatorStub(channel), pb_grpc.CoordinatorStub(other)
        lane = _lane_of(stub, target)
        lane_channel = _channel(lane, credentials) if lane else None
        while time.monotonic() < deadline:
            if progress is not None:
                step = max(first, progress())
            generation = _generation(stub)
            # Made as they are sent, the digest claims first: the lane calls import the
            # data plane (torch) in the first volley. Built before any call, they held the
            # first claims back to step 9-17 of a 30-step job on a loaded 2-core machine
            # (from step 4); sent first, they land at step 3-4.
            calls = itertools.chain(
                _calls(stub, fingerprint, step, generation, victim, ranks),
                _lane_calls(lane_channel, fingerprint, step, generation, victim)
                if lane_channel is not None
                else (),
                [("leader's propose", lambda step=step: _leaders_propose(victims, step))]
                if victims_coordinator is not None
                else (),
            )
            for kind, call in calls:
                try:
                    call()
                    answered[kind] += 1
                except grpc.RpcError:
                    pass
            step += 1
            time.sleep(0.3)
        if lane_channel is not None:
            lane_channel.close()
    return answered


def _lane_of(stub: pb_grpc.CoordinatorStub, coordinator: str) -> str | None:
    """The rank-0 lane of the site whose coordinator is at ``coordinator``, as anyone
    may read it from GetMembership."""
    try:
        membership = stub.GetMembership(pb.GetMembershipRequest(), timeout=2)
    except grpc.RpcError:
        return None
    for info in membership.sites:
        if info.coordinator_address == coordinator and info.lane_addresses:
            return info.lane_addresses[0]
    return None


def _lane_calls(channel: grpc.Channel, fingerprint, step: int, generation: int, victim: str):
    """Issue 33, rows 7 and 8: a resend, a bulk ticket and chunks in ``victim``'s name."""
    from isthmus.inter.data import crc32, make_codec
    from isthmus.proto import lane_pb2, lane_pb2_grpc

    lane = lane_pb2_grpc.LaneStub(channel)
    index = int(victim.removeprefix("site"))
    kinds = (lane_pb2.CHUNK_KIND_CONTRIBUTION, lane_pb2.CHUNK_KIND_RESULT)
    for near in range(max(0, step - 2), step + 2):
        for kind in kinds:
            ask = lane_pb2.ResendChunkRequest(
                generation=generation,
                step=near,
                kind=kind,
                chunk_index=0,
                from_site=index,
                nonce=secrets.token_bytes(32),
            )
            yield "resend", lambda ask=ask: lane.ResendChunk(ask, timeout=2)
    ask = lane_pb2.OpenBulkRequest(from_site=index, nonce=secrets.token_bytes(32))
    yield "open bulk", lambda: lane.OpenBulk(ask, timeout=2)
    codec = make_codec(fingerprint.get("sync.codec", "raw")).name
    per = int(fingerprint.get("sync.chunk_bytes", "4096")) // 4
    for ahead in range(1, 3):
        for value in (float("nan"), 1e3):
            payload = struct.pack(f"<{per}f", *([value] * per))
            for kind in kinds:
                chunk = lane_pb2.PushChunksRequest(
                    generation=generation,
                    step=step + ahead,
                    kind=kind,
                    num_chunks=1,
                    from_site=index,
                    total_elements=per,
                    num_elements=per,
                    codec=codec,
                    payload=payload,
                    crc32=crc32(payload),
                )
                yield "chunk", lambda c=chunk: lane.PushChunks(iter([c]), timeout=2)


def _leaders_propose(victims: pb_grpc.CoordinatorStub, step: int) -> None:
    """A next generation of the very members, in their order, in site0's (the
    leader's) name: what anyone can build from GetMembership."""
    now = victims.GetMembership(pb.GetMembershipRequest(), timeout=2)
    victims.Propose(
        pb.ProposeRequest(
            leader="site0", generation=now.generation + 1, sites=list(now.sites), start_step=step
        ),
        timeout=2,
    )


def missed_forgeries(log: str, victims_log: str, lane_log: str) -> str:
    """Why the logs of the target site, of the victim and of the target's rank-0 lane
    show that not every forged call was found out, or ""."""
    # With TLS the caller holds site0's certificate: a claim to be site1 is refused for
    # it before anything else is looked at.
    certificate = "its certificate does not name site 'site1'"
    streams = "certificate names no peer site of site0"
    # Refused chunk by chunk, or (no pass, another site's certificate) with their stream.
    if not any(s in lane_log for s in ("without a ticket or pass granted to", streams)):
        return "the chunks in the victim's name were never refused (nothing in the lane's log)"
    asked = ("that the site did not ask for", "met so far asked for", certificate)
    if not any(s in lane_log for s in asked):
        return "the resends and bulk tickets asked in the victim's name were never checked"
    if "does not propose generation" not in victims_log:
        return "the Propose in the leader's name was never checked with the leader"
    if "without the key it registered with" not in log:
        return "the forged votes were never refused (nothing in the site's log)"
    if not any(s in log for s in ("the claim is dropped", "could not confirm", certificate)):
        return "the forged digest was never checked with the site it named"
    return ""


def _generation(stub: pb_grpc.CoordinatorStub) -> int:
    """The job's generation, as anyone may ask it (GetMembership needs no rank key)."""
    try:
        return stub.GetMembership(pb.GetMembershipRequest(), timeout=2).generation or 1
    except grpc.RpcError:
        return 1


def _calls(stub, fingerprint, step: int, generation: int, victim: str, ranks: int):
    # Digests for every step around the job's: a claim the real site1 has not yet
    # overwritten meets site0's own digest. Every step, not every other one: the chaos
    # jobs digest every 2 steps, but per-step sync's digests fall after odd steps and an
    # outer mode's on the steps its rounds land.
    for near in range(max(2, step - 6), step + 8):
        digest = secrets.token_hex(32)
        beat = pb.HeartbeatRequest(
            site=victim, step=near, digest=digest, digest_step=near, generation=generation
        )
        yield "heartbeat", functools.partial(stub.Heartbeat, beat, timeout=2)
    index, nowhere = int(victim.removeprefix("site")), "127.0.0.1:9"
    forger = pb.SiteInfo(
        name=victim, index=index, lane_addresses=[nowhere] * ranks, coordinator_address=nowhere
    )
    fields = pb.JobFingerprint(fields=dict(fingerprint))
    join = pb.JoinRequest(
        site=forger, fingerprint=fields, ready=True, generation=0, incarnation=secrets.token_hex(8)
    )
    yield "join", functools.partial(stub.Join, join, timeout=2)
    for ahead in range(1, 4):
        vote = pb.CommitStepRequest(
            site="site0", rank=0, step=step + ahead, generation=generation, ok=False
        )
        yield "vote", functools.partial(stub.CommitStep, vote, timeout=2)
    members = [forger, pb.SiteInfo(name="site0", index=0)]
    proposal = pb.ProposeRequest(
        leader=victim, generation=generation + 1, sites=members, start_step=step
    )
    yield "propose", functools.partial(stub.Propose, proposal, timeout=2)


def forge_rejoin(
    target: str,
    victims_coordinator: str,
    duration_s: float,
    record: Path,
    *,
    credentials: SiteSecurity | None = None,
    progress: Callable[[], int] | None = None,
) -> None:
    """Issue 63, rows 1-2, while site1 restarts and rejoins: heartbeats in site0's name
    telling site1's coordinator "site0 ran its last step" (one once made a restarting
    site1 give up for good), and, ten times a second, pulls of the state offered to site1
    from site0's rank-0 lane in site1's name. Neither may work: site1 asks site0, and the
    lane serves the state only to the pull site1's own lane confirms. What the forger was
    served goes to ``record`` (JSON) after every pull, for the judge."""
    from isthmus.proto import lane_pb2, lane_pb2_grpc

    tally = {"finished": 0, "pulls": 0, "pieces": 0}
    deadline = time.monotonic() + duration_s
    with (
        _channel(target, credentials) as channel,
        _channel(victims_coordinator, credentials) as other,
    ):
        stub, victims = pb_grpc.CoordinatorStub(channel), pb_grpc.CoordinatorStub(other)
        lane_address = _lane_of(stub, target)
        lane_channel = _channel(lane_address, credentials) if lane_address else None
        lane = lane_pb2_grpc.LaneStub(lane_channel) if lane_channel else None
        last_claim = 0.0
        while time.monotonic() < deadline:
            step = progress() if progress is not None else 0
            generation = _generation(stub)
            if time.monotonic() - last_claim >= 0.3:
                last_claim = time.monotonic()
                said = pb.HeartbeatRequest(
                    site="site0", step=step, generation=generation, finished=True
                )
                try:
                    victims.Heartbeat(said, timeout=2)
                    tally["finished"] += 1
                except grpc.RpcError:
                    pass  # site1 is down or starting: it is told again
            for near in range(max(0, step - 2), step + 3) if lane is not None else ():
                ask = lane_pb2.PullStateRequest(
                    generation=generation,
                    step=near,
                    rank=0,
                    site="site1",
                    from_rank=0,
                    nonce=secrets.token_bytes(32),  # a nonce's size: only its maker knows it
                )
                tally["pulls"] += 1
                try:
                    for _ in lane.PullState(ask, timeout=2):  # type: ignore[union-attr]
                        tally["pieces"] += 1
                except grpc.RpcError:
                    pass  # not offered, or refused: what must happen
            record.write_text(json.dumps(tally))
            time.sleep(0.1)
        if lane_channel is not None:
            lane_channel.close()


def missed_rejoin_forgeries(victims_log: str, record: Path) -> str:
    """Why the forger of ``forge_rejoin`` was believed or served, or ""."""
    try:
        tally = json.loads(record.read_text())
    except (OSError, ValueError):
        return "the forger of the rejoin never ran"
    if tally["pieces"]:
        return f"a pull in site1's name was served {tally['pieces']} piece(s) of the state"
    if not tally["finished"]:
        return "no forged 'site0 finished' heartbeat reached site1"
    if "site0 itself says it runs step" not in victims_log:
        return "the forged 'site0 finished' claims were never checked with site0"
    return ""
