"""Step commit and failover between real coordinators on loopback (inter/control/failover.py).

Each site has one "rank" played by the test (tests/coordinators.py). Sites die by
stopping their coordinator (its heartbeats and answers stop, as when its machine
dies); a partition cuts the emulated link.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from coordinators import (
    coordinator,
    linked_pair,
    names,
    rank_key,
    restart_site1,
    retry_until,
    running_sites,
    site1_restarted,
    start_sites,
    stop_all,
    vote,
    vote_all,
)
from helpers import wait_until

from isthmus.inter.control.failover import has_quorum
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc
from isthmus.sim import Flap, RelayServer

pytestmark = pytest.mark.timeout(90)


def test_quorum_is_a_majority_or_half_with_the_first_site():
    sites = ["site0", "site1", "site2", "site3"]
    assert has_quorum(["site0", "site1", "site2"], sites)
    assert has_quorum(["site0", "site3"], sites)  # half, with the tie-breaker
    assert not has_quorum(["site1", "site2"], sites)  # the other half
    assert has_quorum(["site0"], ["site0", "site1"])
    assert not has_quorum(["site1"], ["site0", "site1"])
    # A job with a witness has no tie-breaker: an even split asks the witness.
    assert not has_quorum(["site0"], ["site0", "site1"], tie_break=False)
    assert has_quorum(["site0", "site1", "site2"], ["site0", "site1", "site2"], tie_break=False)
    assert not has_quorum(["site2"], ["site0", "site1", "site2"])
    assert not has_quorum(["stranger", "site0"], ["site0", "site1", "site2"])


def test_every_site_ok_commits_the_step_everywhere():
    with running_sites(3) as coords:
        decisions = vote_all(coords, step=0, generation=1)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_COMMIT}
        assert {d.generation for d in decisions.values()} == {1}
        assert all(c.state.committed_steps == 1 for c in coords)


def test_a_failed_round_is_retried_by_the_same_members_in_a_new_generation():
    with running_sites(2) as coords:
        decisions = vote_all(coords, step=0, generation=1, ok={"site1": False})
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_RETRY}
        assert {d.generation for d in decisions.values()} == {2}
        assert all(names(d) == ["site0", "site1"] for d in decisions.values())
        assert all(c.state.committed_steps == 0 for c in coords)  # nothing applied
        again = vote_all(coords, step=0, generation=2)
        assert {d.verdict for d in again.values()} == {pb.VERDICT_COMMIT}


@pytest.mark.parametrize("dead", [2, 0], ids=["a_dead_site_is_dropped", "the_leader_dies"])
def test_the_others_carry_on_without_a_dead_site(dead):
    """A site dies between steps, site2, or the leader (site0, the lowest index): the
    next site takes over and the two others go on."""
    with running_sites(3) as coords:
        assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
        coords[dead].stop(grace_s=0)
        alive = coords[:dead] + coords[dead + 1 :]
        members = [c.site for c in alive]
        generation = retry_until(alive, 1, 1, members, ok={members[0]: False})
        after = vote_all(alive, step=1, generation=generation)
        assert {d.verdict for d in after.values()} == {pb.VERDICT_COMMIT}
        assert alive[0].live_members() == alive[1].live_members() == members


def test_a_commit_given_out_before_the_leader_died_stands():
    """site2 heard COMMIT for step 0 from site0, site1 did not: when site0 dies, site1
    takes over and must not retry a step site2 already applied."""
    with running_sites(3) as coords:
        # site1's vote reaches the leader, but site1 never hears the answer.
        with grpc.insecure_channel(coords[0].address) as channel:
            pb_grpc.CoordinatorStub(channel).SiteVote(
                pb.SiteVoteRequest(site="site1", step=0, generation=1, ok=True, wait_ms=0),
                timeout=5,
            )
        decisions = vote_all([coords[0], coords[2]], step=0, generation=1)
        assert {d.verdict for d in decisions.values()} == {pb.VERDICT_COMMIT}
        assert coords[2].state.committed_steps == 1
        assert coords[1].state.committed_steps == 0
        coords[0].stop(grace_s=0)
        decision = vote(coords[1], 0, 1)  # site1 asks; site0 is gone; site1 is next
        assert decision.verdict == pb.VERDICT_COMMIT, decision
        assert names(decision) == ["site1", "site2"] and decision.generation > 1
        assert coords[1].state.committed_steps == 1


def test_a_restarted_site_is_admitted_at_a_commit_with_the_state_source():
    with running_sites(2) as coords:
        # site1 comes back at the same address, from generation 0.
        again, generation = site1_restarted(coords, lane="127.0.0.1:2999")
        # Its joins reach site0, which asks site1 itself and takes it as a joiner.
        wait_until(lambda: "site1" in coords[0].failover.ballots.joiners, "site1 never joined")
        admit = vote(coords[0], 2, generation)
        assert admit.verdict == pb.VERDICT_COMMIT
        assert names(admit) == ["site0", "site1"] and admit.generation > generation
        assert admit.state_source == "site0" and admit.state_step == 2
        sites = again.wait_ready(10)
        assert [s.name for s in sites] == ["site0", "site1"]
        assert again.start_step == 3 and again.state_source == "site0"
        assert sites[1].lane_addresses == ["127.0.0.1:2999"]


def test_a_site_restarted_before_the_first_commit_is_taken_for_dead_and_admitted():
    """In DiLoCo the first commit comes only after inner_steps steps; a site restarted
    before it must not pass for a late starter (the other site's round would wait on
    chunks its dead incarnation never sent): its new incarnation gives it away."""
    with running_sites(2) as coords:
        before = coords[1].incarnations.mine
        coords[1].stop(grace_s=0)
        again = coords[1] = restart_site1(coords[1].address, coords[0], lane="127.0.0.1:2998")
        assert again.incarnations.mine != before
        # site0 asks site1 at its address and learns the new incarnation: a restart.
        mine = again.incarnations.mine
        wait_until(lambda: coords[0].incarnations.get("site1") == mine, "restart never seen")
        with coords[0].state.cond:
            assert "site1" in coords[0].state.restarted  # suspected for it, not for silence
            assert coords[0].state.suspects_locked() == ["site1"]
        generation = retry_until(coords[:1], 4, 1, ["site0"], ok={"site0": True})
        admit = vote(coords[0], 4, generation)
        assert admit.verdict == pb.VERDICT_COMMIT
        assert names(admit) == ["site0", "site1"] and admit.state_step == 4
        assert again.wait_ready(10) and again.start_step == 5


def test_a_site_that_only_answered_joins_is_known_by_its_incarnation():
    """Seen on a GPU host: site1 answered site0's joins but never reached site0 itself, so
    site0 did not know site1's incarnation and took its restart for a late start."""
    site0, site1 = (coordinator(name, ["site0", "site1"]) for name in ("site0", "site1"))
    try:
        site1.set_peers({"site0": "127.0.0.1:1"})  # its own joins go nowhere
        site0.set_peers({"site1": site1.address})
        site1.start()
        site0.start()
        wait_until(lambda: site0.incarnations.get("site1") is not None, "site1 never answered")
        assert site0.incarnations.get("site1") == site1.incarnations.mine  # from site1's answers
        assert site1.incarnations.get("site0") == site0.incarnations.mine  # from site0's joins
    finally:
        stop_all([site0, site1])


def test_a_site_admitted_back_pulls_the_state_though_its_old_vote_was_settled_meanwhile():
    """The partition scenario's race (it deadlocked ~1 run in 9): site1, cut off at step
    4, is admitted back by site0's Propose while its ranks still wait on their step-4
    vote of generation 1. Its failover loop settles that old vote ("generation moved
    on") at about the same moment; the ranks must still get REJOIN and pull the state,
    never a RETRY that reruns step 4 in a generation whose other member left it behind."""
    with running_sites(2) as coords:
        site1 = coords[1]
        with pytest.raises(AssertionError, match="no decision"):
            vote(site1, 4, 1, wait_s=1.5)  # the vote stands; nobody else votes on step 4
        with site1.state.cond:
            site1.state.exclude_locked("its heartbeats tell it: left out")
            sites = site1.state.infos_locked(site1.site_names)
        admit = pb.ProposeRequest(
            leader="site0", generation=3, sites=sites, start_step=21, state_source="site0"
        )
        with coords[0].state.cond:  # site0 proposes it (site1 asks site0 before adopting it)
            coords[0].failover.leader.proposing[3] = ["site0", "site1"]
        with grpc.insecure_channel(site1.address) as channel:
            assert pb_grpc.CoordinatorStub(channel).Propose(admit, timeout=5).accepted
        site1.failover.settle((4, 1))  # what its loop does with the old vote
        decision = vote(site1, 4, 1, wait_s=5)
        assert decision.verdict == pb.VERDICT_REJOIN, decision
        assert decision.generation == 3 and decision.state_source == "site0"
        assert decision.step == 21 and decision.state_step == 20


def test_under_a_partition_only_the_quorum_side_goes_on_and_the_other_stops_saying_why():
    with RelayServer() as relay:
        link, proxies = linked_pair(relay)
        coords = start_sites(2, proxies=proxies, quorum_wait_s=2.0)
        try:
            assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
            dark = (Flap(duration_s=60),)
            link.set_impairments(dark, dark)
            link.reset()
            # site0 holds the tie-break: it goes on alone. site1 may not.
            stopped = {}
            waiting = threading.Thread(
                target=lambda: stopped.update(d=vote(coords[1], 1, 1, False))
            )
            waiting.start()
            retry_until(coords[:1], 1, 1, ["site0"], ok={"site0": False})
            waiting.join(20)
            assert stopped["d"].verdict == pb.VERDICT_STOP
            assert "lost quorum" in stopped["d"].reason and "site1" in stopped["d"].reason
        finally:
            link.set_impairments((), ())
            stop_all(coords)


@pytest.mark.parametrize(
    "request_fields, why",
    [
        ({"site": "site1", "rank": 0, "step": 0, "generation": 1}, "sent to the coordinator"),
        ({"site": "site0", "rank": 7, "step": 0, "generation": 1}, "is not one of"),
        ({"site": "site0", "rank": 0, "step": 0, "generation": 0}, "out of range"),
        ({"site": "site0", "rank": 0, "step": 1 << 50, "generation": 1}, "out of range"),
        ({"site": "site0", "rank": 0, "step": 0, "generation": 9}, "ahead of"),
        # Issue 14, row 3: forged votes for coming steps once froze a job.
        ({"site": "site0", "rank": 0, "step": 0, "generation": 1, "rank_key": "f" * 32}, "key"),
        ({"site": "site0", "rank": 0, "step": 0, "generation": 1, "rank_key": ""}, "key"),
        ({"site": "site0", "rank": 0, "step": 65, "generation": 1}, "more than 64 steps past"),
    ],
)
def test_bad_votes_are_refused_and_change_nothing(request_fields, why):
    with running_sites(2) as coords:
        fields = {"rank_key": rank_key(coords[0]), **request_fields}
        with (
            grpc.insecure_channel(coords[0].address) as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            pb_grpc.CoordinatorStub(channel).CommitStep(
                pb.CommitStepRequest(**fields, ok=True, wait_ms=0), timeout=5
            )
        assert why in err.value.details()
        assert coords[0].failover.ballots.rank_votes == {}
        assert coords[0].generation == 1


def test_a_propose_from_a_stranger_or_with_a_lower_generation_changes_nothing():
    with running_sites(2) as coords:
        site0 = coords[0].state.infos_locked(coords[0].members)
        with grpc.insecure_channel(coords[1].address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Propose(
                    pb.ProposeRequest(leader="mallory", generation=9, sites=site0), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            answer = stub.Propose(
                pb.ProposeRequest(leader="site0", generation=1, sites=site0), timeout=5
            )
        assert not answer.accepted and answer.generation == 1
        assert coords[1].live_members() == ["site0", "site1"]


def test_a_propose_that_reorders_the_members_is_refused():
    """Issue 14, row 4: accepted, it froze the job's steps for good, silently."""
    with running_sites(2) as coords:
        reordered = list(reversed(coords[0].state.infos_locked(coords[0].members)))
        with (
            grpc.insecure_channel(coords[1].address) as channel,
            pytest.raises(grpc.RpcError) as err,
        ):
            pb_grpc.CoordinatorStub(channel).Propose(
                pb.ProposeRequest(leader="site0", generation=2, sites=reordered), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "in the job's order ['site0', 'site1']" in err.value.details()
        assert coords[1].generation == 1 and coords[1].live_members() == ["site0", "site1"]
