"""Replica digests (inter/control/replicas.py): a peer's claim that differs from this site's
own digest is doubted until the peer, asked at its own address, confirms or belies it."""

from __future__ import annotations

from isthmus.inter.control.replicas import ReplicaDigests, layout_difference

A, B = "a" * 64, "b" * 64


def test_a_claim_the_peer_belies_is_dropped_and_a_confirmed_one_diverges():
    replicas = ReplicaDigests("site0")
    assert replicas.record("site0", 4, A) is None
    replicas.claim("site1", 4, B)  # a heartbeat anyone could have sent
    assert replicas.divergence is None and replicas.doubted("site1") == 4
    assert replicas.agree_at(4, ["site0", "site1"]) is None
    assert replicas.confirm("site1", 4, A) is None  # site1 itself: same as ours
    assert replicas.forged == 1 and replicas.doubted("site1") is None
    assert replicas.agree_at(4, ["site0", "site1"]) is True
    replicas.claim("site1", 4, B)  # a confirmed digest is not overwritten by claims
    assert replicas.agree_at(4, ["site0", "site1"]) is True

    replicas.claim("site1", 6, B)  # a claim first, this site's own digest later
    assert replicas.record("site0", 6, A) is None and replicas.doubted("site1") == 6
    assert "replicas differ after step 6" in replicas.confirm("site1", 6, B)
    assert replicas.agree_at(6, ["site0", "site1"]) is False


def test_a_forged_claim_replaced_by_the_real_one_is_still_found_out():
    """A forged claim for a step ahead, then the peer's real heartbeat for it before this
    site gets there: the real one matches this site's own digest, but two claims for one
    step mean one was forged. The peer, asked, says which; nothing diverges."""
    replicas = ReplicaDigests("site0")
    replicas.claim("site1", 5, B, live=3)  # forged, ahead
    replicas.claim("site1", 5, A, live=4)  # site1's own heartbeat
    assert replicas.doubted("site1") == 5
    assert replicas.record("site0", 5, A) is None
    assert replicas.agree_at(5, ["site0", "site1"]) is None  # settled first
    assert replicas.confirm("site1", 5, A) is None
    assert replicas.forged == 1 and replicas.divergence is None
    assert replicas.agree_at(5, ["site0", "site1"]) is True
    replicas.claim("site1", 7, A, live=6)  # the same claim twice is not two claims
    replicas.claim("site1", 7, A, live=6)
    assert replicas.doubted("site1") is None
    for k in range(100):  # a flood of claims for one step keeps only a few of them
        replicas.claim("site1", 9, f"{k:064x}", live=8)
    replicas.claim("site1", 9, A, live=8)
    assert replicas.doubted("site1") == 9
    replicas.confirm("site1", 9, A)
    assert replicas.forged == 1 + 4 and replicas.doubted("site1") is None


def test_a_claim_the_peer_cannot_confirm_is_dropped_without_a_divergence():
    replicas = ReplicaDigests("site0")
    replicas.record("site0", 4, A)
    replicas.claim("site1", 4, B)
    assert replicas.confirm("site1", 4, "") is None  # it has no step 4 (not yet, or no more)
    assert replicas.divergence is None and "site1" not in replicas.latest()
    replicas.claim("site1", 4, A)  # its real heartbeat, later
    assert replicas.agree_at(4, ["site0", "site1"]) is True


def test_matching_claims_need_no_confirmation_and_old_steps_are_forgotten():
    replicas = ReplicaDigests("site0")
    for step in range(40):
        replicas.record("site0", step, A)
        replicas.claim("site1", step, A)
    assert replicas.doubted("site1") is None and replicas.agree_at(39, ["site0", "site1"])
    assert replicas.agree_at(0, ["site0", "site1"]) is None  # kept only the last 16


def test_claims_far_ahead_are_refused_and_never_evict_the_digests_in_reach():
    """Issue 33, row 1: 16 heartbeats in site1's name claiming digests for steps
    10^9..10^9+15 evicted the real ones; the job ended without a final digest."""
    replicas = ReplicaDigests("site0")
    for step in (8, 10):
        replicas.record("site0", step, A)
        assert replicas.claim("site1", step, A, live=step) is None
    for step in range(10**9, 10**9 + 16):
        refused = replicas.claim("site1", step, B, live=10)
        assert refused is not None and "more than 64 steps past this site's 10" in refused
    for step in range(11, 11 + 64):  # within reach, but past this site's step
        assert replicas.claim("site1", step, B, live=10) is None
    assert replicas.agree_at(10, ["site0", "site1"]) is True  # the real ones stayed
    assert replicas.agree_at(8, ["site0", "site1"]) is True
    assert max(s for s in range(11, 75) if replicas.agree_at(s, ["site1"]) is not None) == 14
    # An honest peer ahead is taken once this site comes within reach.
    assert replicas.claim("site1", 200, A, live=120) is not None
    assert replicas.claim("site1", 200, A, live=150) is None


def test_sites_whose_models_differ_are_told_the_first_differing_parameter():
    """Issue 60: a different model on each site hung with "sent 241 elements, expected
    161" in rank logs. Its start is compared by digest, and a peer's layout taken only
    from its own answer names the parameter; a claimed layout is never read."""
    mine = "0.weight (8, 4) float32\n0.bias (8,) float32\n1.weight (1, 8) float32"
    theirs = mine.replace("(8, 4)", "(16, 4)")
    replicas = ReplicaDigests("site0")
    replicas.record("site0", 0, A, mine)
    replicas.claim("site1", 0, B)
    assert replicas.own_layout() == mine
    said = replicas.confirm("site1", 0, B, theirs)
    assert said == (
        "the sites build different models: parameter '0.weight' is (8, 4) float32 at "
        "site0 and (16, 4) float32 at site1; every site must build the same model (the "
        "same code and sizes)"
    )
    # The same model from another seed: the layouts agree, so the seed is the cause.
    replicas = ReplicaDigests("site0")
    replicas.record("site0", 0, A, mine)
    replicas.claim("site1", 0, B)
    assert "the sites start from different parameters" in replicas.confirm("site1", 0, B, mine)
    # Another dtype, another name, one parameter more: each named.
    assert layout_difference(
        "a", mine, "b", mine.replace("0.bias (8,) float32", "0.bias (8,) bfloat16")
    ) == ("parameter '0.bias' is (8,) float32 at a and (8,) bfloat16 at b")
    assert layout_difference("a", mine, "b", mine.replace("0.bias", "0.b")) == (
        "parameter 1 is '0.bias' ((8,) float32) at a and '0.b' ((8,) float32) at b"
    )
    assert layout_difference("a", mine, "b", mine + "\n2.weight (1,) float32") == (
        "a has 3 parameters and b 4; the first only b has is '2.weight'"
    )
    assert layout_difference("a", mine, "b", "") == ""  # unknown: the digests speak
