"""A rank that dies while its site's coordinator lives (inter/control/rank_liveness.py):
real coordinators on loopback, ranks played by the test. Each rank beats as a real
one does: a watcher thread long-polls GetMembership with the rank's key without pause
(inter/data/sync/membership.py); a rank dies by stopping it (its poll cancelled, as when
the process is killed). site0 has one rank, site1 two."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from coordinators import FAST, FP, coordinator, stop_all
from helpers import register_rank, wait_until

from isthmus.inter.control.coordinator import Coordinator
from isthmus.inter.control.coordinator_client import CoordinatorClient
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

SILENCE_S = FAST["failure_timeout_s"]  # a rank silent this long is dead
POLL_S = 1.0  # a watcher's poll is held this long; a rank killed mid-poll ends it then
SIZES = (1, 2)


class Watcher:
    """A rank's membership watcher: its beat, from a thread of its own."""

    def __init__(self, coord: Coordinator, rank: int) -> None:
        self.coord = coord
        self.client = CoordinatorClient.connect(
            coord.address, rank_key=coord.rank_keys.handed(rank)
        )
        self.stopped = threading.Event()
        self._poll: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _hold(self, call: grpc.Future) -> None:
        self._poll = call
        if self.stopped.is_set():
            call.cancel()

    def _run(self) -> None:
        while not self.stopped.is_set():
            known = self.coord.generation
            try:
                reply = self.client.membership_now(
                    known_generation=known,
                    wait_ms=int(POLL_S * 1000),
                    timeout_s=6,
                    on_call=self._hold,
                )
            except (grpc.RpcError, grpc.FutureCancelledError):
                return
            if reply.generation != known or reply.suspects:
                self.stopped.wait(0.25)  # answered at once: paced, as the real watcher

    def kill(self) -> None:
        self.stopped.set()
        if self._poll is not None:
            self._poll.cancel()
        self._thread.join(5)
        self.client.close()


def start() -> list[Coordinator]:
    names = ["site0", "site1"]
    coords = [coordinator(n, names, ranks=SIZES[i], site_ranks=SIZES) for i, n in enumerate(names)]
    for c in coords:
        c.set_peers({s.site: s.address for s in coords if s is not c})
        c.start()
    for i, c in enumerate(coords):
        register_all(c, port=2000 + 10 * i)
    for c in coords:
        c.wait_ready(20)
    return coords


def register_all(coord: Coordinator, port: int) -> None:
    for rank in range(coord.ranks):
        key = coord.rank_keys.handed(rank)
        lane = f"127.0.0.1:{port + rank}"
        register_rank(
            coord.address, coord.site, FP, key=key, lane=lane, rank=rank, world_size=coord.ranks
        )


def vote(coord: Coordinator, rank: int, step: int, generation: int, out: dict) -> threading.Thread:
    """A rank's vote, on a thread: ``out[(site, rank)]`` = (decision, when it came)."""

    def run() -> None:
        client = CoordinatorClient.connect(coord.address, rank_key=coord.rank_keys.handed(rank))
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                decision = client.commit_step(
                    site=coord.site, rank=rank, step=step, generation=generation, ok=True,
                    wait_ms=1000, timeout_s=5,
                )  # fmt: skip
                if decision.verdict != pb.VERDICT_PENDING:
                    out[(coord.site, rank)] = (decision, time.monotonic())
                    return
        finally:
            client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_rank_that_keeps_beating_but_votes_late_is_not_declared_dead():
    coords = start()
    watchers = [Watcher(c, r) for c in coords for r in range(c.ranks)]
    try:
        out: dict = {}
        early = [vote(coords[0], 0, 0, 1, out), vote(coords[1], 0, 0, 1, out)]
        # site1's rank 1 computes (a compile, a checkpoint save) for three silences,
        # its watcher beating meanwhile: no one is declared dead.
        late_at = time.monotonic() + 3 * SILENCE_S
        while time.monotonic() < late_at:
            assert coords[1].rank_liveness.left_for is None
            with coords[0].state.cond:
                assert coords[0].state.suspects_locked() == []
            time.sleep(0.05)
        vote(coords[1], 1, 0, 1, out).join(20)
        for thread in early:
            thread.join(20)
        assert {d.verdict for d, _ in out.values()} == {pb.VERDICT_COMMIT}, out
        assert len(out) == 3, out
        assert coords[0].members == coords[1].members == ["site0", "site1"]
    finally:
        for w in watchers:
            w.kill()
        stop_all(coords)


def test_a_rank_that_stops_beating_makes_its_site_leave_then_rejoin():
    coords = start()
    site0, site1 = coords
    watchers = {(c.site, r): Watcher(c, r) for c in coords for r in range(c.ranks)}
    try:
        out: dict = {}
        for thread in [vote(c, r, 0, 1, out) for c in coords for r in range(c.ranks)]:
            thread.join(20)
        assert {d.verdict for d, _ in out.values()} == {pb.VERDICT_COMMIT}, out
        # Step 1: site1's rank 1 dies before it votes; the others wait on the step.
        out.clear()
        waiting = [vote(site0, 0, 1, 1, out), vote(site1, 0, 1, 1, out)]
        wait_until(lambda: len(site1.failover.ballots.rank_votes.get((1, 1), {})) == 1, "no vote")
        watchers.pop(("site1", 1)).kill()
        killed_at = time.monotonic()
        wait_until(lambda: site1.rank_liveness.left_for is not None, "rank 1 never declared dead")
        declared_s = time.monotonic() - killed_at
        for thread in waiting:
            thread.join(20)
        # Dead after its silence, not before; and not much after (a poll it had in
        # flight ends at most POLL_S later; the rest is this loaded machine's slack).
        assert SILENCE_S <= declared_s < POLL_S + SILENCE_S + 2.0, declared_s
        left, left_at = out[("site1", 0)]
        assert left.verdict == pb.VERDICT_STOP and "rank 1 of site1" in left.reason, left
        assert site1.state.lanes == [None, None] and site1.excluded
        # site0 goes on alone at once: a retry without site1, nothing applied.
        retry, retry_at = out[("site0", 0)]
        assert retry.verdict == pb.VERDICT_RETRY, retry
        assert [i.name for i in retry.sites] == ["site0"] and retry.generation == 2, retry
        assert retry_at - killed_at < POLL_S + SILENCE_S + 3.0, retry_at - killed_at
        assert site0.state.committed_steps == 1
        # site1's ranks start again: registered, it is admitted back with site0's state.
        watchers.pop(("site1", 0)).kill()
        register_all(site1, port=2020)
        wait_until(lambda: "site1" in site0.failover.ballots.joiners, "site1 never asked back")
        out.clear()
        vote(site0, 0, 1, 2, out).join(20)
        admitted, _ = out[("site0", 0)]
        assert admitted.verdict == pb.VERDICT_COMMIT, admitted
        assert [i.name for i in admitted.sites] == ["site0", "site1"], admitted
        wait_until(lambda: site1.state.running, "site1 never adopted its readmission")
        assert (site1.state_source, site1.start_step, site1.generation) == ("site0", 2, 3)
        assert site1.rank_liveness.left_for is None
    finally:
        for w in watchers.values():
            w.kill()
        stop_all(coords)


def test_a_frozen_agents_open_poll_vouches_for_its_ranks_no_longer_than_the_silence():
    """A node frozen or cut off without a reset (issue 59: `isthmus chaos`'s node-silent)
    leaves its host agent's long poll open at the coordinator: nothing ends it, and a
    poll in flight is a beat. The coordinator holds such a poll half the silence at
    most, so the node's ranks are found dead within 1.5 x the silence, not after the
    agent's 10 s ask."""
    coords = start()
    site1 = coords[1]
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(site1.address))
    keys = [site1.rank_keys.handed(r) for r in range(site1.ranks)]
    ask = pb.GetMembershipRequest(
        known_generation=site1.generation, wait_ms=10_000, rank_key=keys[0], vouched_rank_keys=keys
    )
    try:
        # The agent's last poll before its node froze: answered (no news) after the hold.
        sent = time.monotonic()
        # Held (not dropped: a dropped future ends its call), never cancelled or followed.
        poll = stub.GetMembership.future(ask, timeout=30)
        wait_until(lambda: site1.rank_liveness.left_for is not None, "never declared dead", 20)
        declared_s = time.monotonic() - sent
        assert poll.done()  # answered after half the silence, not the 10 s it asked
        # Half the silence held, then the silence: 1.2 s here, far from the 10 s asked.
        # Dead after its silence, never before (load only delays it); held the whole 10 s
        # it would be declared after 10.8 s: half of that leaves a loaded machine slack.
        assert SILENCE_S < declared_s < 5.0, declared_s
        assert "of site1 silent" in site1.rank_liveness.left_for, site1.rank_liveness.left_for
    finally:
        stop_all(coords)
