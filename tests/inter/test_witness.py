"""The witness (inter/control/witness.py): with it, two sites survive the loss of either, and a
partition still lets only one side go on. Real coordinators and a witness on loopback;
and the witness under mutual TLS."""

from __future__ import annotations

import grpc
import pytest
from coordinators import (
    FP,
    linked_pair,
    names,
    retry_until,
    start_sites,
    stop_all,
    vote,
    vote_all,
)

from isthmus.deploy.commands.certs import write_certs
from isthmus.inter.control.witness import WitnessServer
from isthmus.inter.security import SiteSecurity
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc
from isthmus.sim import Flap, RelayServer

pytestmark = pytest.mark.timeout(90)


def test_with_a_witness_two_sites_survive_the_loss_of_site0():
    """Issue 14, point 7: without a witness, losing site0 (the tie-breaker) stops a
    two-site job. With one, site1 is granted the even split once site0 falls silent."""
    witness = WitnessServer(site_names=["site0", "site1"], fingerprint=FP, failure_timeout_s=0.8)
    witness.start()
    coords = start_sites(2, witness=witness.address)
    try:
        assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
        coords[0].stop(grace_s=0)
        generation = retry_until(coords[1:], 1, 1, ["site1"], ok={"site1": False})
        assert vote(coords[1], 1, generation).verdict == pb.VERDICT_COMMIT
        assert witness.holder == ["site1"]
    finally:
        stop_all(coords)
        witness.stop()


def test_with_a_witness_a_partition_still_lets_only_one_side_go_on():
    with RelayServer() as relay:
        link, proxies = linked_pair(relay)
        witness = WitnessServer(
            site_names=["site0", "site1"], fingerprint=FP, failure_timeout_s=0.8
        ).start()
        coords = start_sites(2, proxies=proxies, quorum_wait_s=3.0, witness=witness.address)
        try:
            assert {d.verdict for d in vote_all(coords, 0, 1).values()} == {pb.VERDICT_COMMIT}
            dark = (Flap(duration_s=60),)
            link.set_impairments(dark, dark)  # the sites cut apart; both reach the witness
            link.reset()
            decisions = vote_all(coords, 1, 1, ok={"site0": False, "site1": False})
            verdicts = sorted(pb.Verdict.Name(d.verdict) for d in decisions.values())
            assert verdicts == ["VERDICT_RETRY", "VERDICT_STOP"], decisions
            (going_on,) = [s for s, d in decisions.items() if d.verdict == pb.VERDICT_RETRY]
            assert names(decisions[going_on]) == [going_on] and witness.holder == [going_on]
        finally:
            link.set_impairments((), ())
            stop_all(coords)
            witness.stop()


def test_a_witness_ignores_the_chunk_size_a_site_derives_from_its_gpus():
    """A GPU site on topology.device = "auto" sends 16 MiB chunks where the witness's
    GPU-less host computes the link's 1 MiB from the same job file: the witness moves
    no chunks, so it grants; any other difference is still refused, naming the key."""
    from isthmus.deploy.config.job import load_config

    witness_fp = load_config(overrides=["topology.device=cpu"]).fingerprint()
    site_fp = load_config(overrides=["topology.device=cpu"]).fingerprint()
    site_fp["sync.chunk_bytes"] = str(load_config(overrides=["topology.device=cuda"]).chunk_bytes)
    assert site_fp["sync.chunk_bytes"] != witness_fp["sync.chunk_bytes"]  # 16 MiB vs 1 MiB
    witness = WitnessServer(
        site_names=["site0", "site1"], fingerprint=witness_fp, failure_timeout_s=1.0
    ).start()
    try:
        with grpc.insecure_channel(witness.address) as channel:
            stub = pb_grpc.WitnessStub(channel)
            ask = pb.WitnessGrantRequest(
                site="site0", members=["site0"], fingerprint=pb.JobFingerprint(fields=site_fp)
            )
            assert stub.Grant(ask, timeout=5).granted
            other = dict(site_fp, **{"job.seed": "7"})
            ping = pb.WitnessPingRequest(site="site1", fingerprint=pb.JobFingerprint(fields=other))
            with pytest.raises(grpc.RpcError) as refused:
                stub.Ping(ping, timeout=5)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "job.seed" in refused.value.details()
        assert witness.holder == ["site0"]
    finally:
        witness.stop()


def test_a_witness_with_tls_grants_a_site_only_to_its_own_certificate(tmp_path):
    write_certs(tmp_path, ["site0", "site1", "witness"])

    def tls(site: str) -> SiteSecurity:
        return SiteSecurity.load(tmp_path, site, require_tls=True, require_token=True)

    fingerprint = pb.JobFingerprint(fields={"job.name": "t"})
    witness = WitnessServer(
        site_names=["site0", "site1"],
        fingerprint={"job.name": "t"},
        failure_timeout_s=1.0,
        security=tls("witness"),
    ).start()
    try:
        ask = pb.WitnessGrantRequest(site="site0", members=["site0"], fingerprint=fingerprint)
        with (
            tls("site1").channel(witness.address) as channel,  # not site0's certificate
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.WitnessStub(channel).Grant(ask, timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert witness.holder == []
        with tls("site0").channel(witness.address) as channel:
            assert pb_grpc.WitnessStub(channel).Grant(ask, timeout=5).granted
        assert witness.holder == ["site0"]
    finally:
        witness.stop()
