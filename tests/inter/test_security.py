"""Mutual TLS and the job token, with real TLS on loopback (docs/design.md invariant 6).

Every server here is a real gRPC server bound to port 0 that requires mutual TLS
and the token; clients are refused in the TLS handshake (plaintext, a certificate
of another CA) or by the token check (none, wrong), and a refused call changes no
state. Token refusals are logged with the peer's address; handshake refusals
happen inside gRPC's C core and cannot be (inter/security.py says why).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import assert_one_line_error, raw_chunk, run_cli

from isthmus.deploy.commands.certs import write_certs
from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.security.trust import site_security
from isthmus.inter.control.channels import peer_channel
from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.rank_keys import RankKeys, process_key
from isthmus.inter.data.lane.peer import LanePeer
from isthmus.inter.data.lane.server import LaneServer
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.transport.wire import Frame
from isthmus.inter.security import TLS_NAME, SiteSecurity
from isthmus.proto import coordinator_pb2 as cpb
from isthmus.proto import coordinator_pb2_grpc as cpb_grpc
from isthmus.proto import lane_pb2, lane_pb2_grpc
from isthmus.sim import LinkSpec, RelayServer

pytestmark = pytest.mark.timeout(60)

SITES = ["site0", "site1"]
PEER = re.compile(r"from ipv4:127\.0\.0\.1:\d+")


@pytest.fixture(scope="module")
def rogue_dir(tmp_path_factory) -> Path:
    """Certificates of another job: same site names, another CA, another token."""
    out = tmp_path_factory.mktemp("rogue-certs")
    write_certs(out, SITES)
    return out


def full(folder: Path, site: str) -> SiteSecurity:
    return SiteSecurity.load(folder, site, require_tls=True, require_token=True)


def clients(job_dir: Path, rogue_dir: Path) -> dict[str, SiteSecurity | None]:
    """Every kind of client a server requiring TLS and the token meets; None = plaintext."""
    good, rogue = full(job_dir, "site1"), full(rogue_dir, "site1")
    return {
        "plaintext": None,
        # Trusts the job CA, so only the server can object: to the client certificate.
        "other_ca_cert": SiteSecurity(
            require_tls=True, ca=good.ca, cert=rogue.cert, key=rogue.key, token=good.token
        ),
        "no_token": SiteSecurity(require_tls=True, ca=good.ca, cert=good.cert, key=good.key),
        "wrong_token": SiteSecurity(
            require_tls=True, ca=good.ca, cert=good.cert, key=good.key, token=rogue.token
        ),
        "valid": good,
    }


def open_channel(security: SiteSecurity | None, address: str, **kw) -> grpc.Channel:
    return (
        security.channel(address, kw.get("options", ()))
        if security
        else grpc.insecure_channel(address)
    )


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    """The RpcError that ``call`` raises (the test fails if the call succeeds)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# The code each client gets: handshake failures are UNAVAILABLE (nothing was served).
REFUSED = {
    "plaintext": (grpc.StatusCode.UNAVAILABLE, None),
    "other_ca_cert": (grpc.StatusCode.UNAVAILABLE, None),
    "no_token": (grpc.StatusCode.UNAUTHENTICATED, "no job token"),
    "wrong_token": (grpc.StatusCode.UNAUTHENTICATED, "wrong job token"),
}


def chunk(**overrides) -> lane_pb2.PushChunksRequest:
    return raw_chunk(**overrides)


@pytest.fixture()
def lane(job_dir) -> LaneServer:
    server = LaneServer(
        site_index=0, num_sites=2, codec="raw", generation=1, security=full(job_dir, "site0")
    )
    yield server
    server.stop(0)


# -- the data plane ------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_lane_refuses_unauthenticated_peers_and_keeps_its_mailbox(
    lane, job_dir, rogue_dir, kind, caplog
):
    client = clients(job_dir, rogue_dir)[kind]
    code, why = REFUSED[kind]
    caplog.set_level(logging.WARNING, logger="isthmus.inter.security")
    with open_channel(client, lane.address) as channel:
        refused = refusal(
            lambda: lane_pb2_grpc.LaneStub(channel).PushChunks(iter([chunk()]), timeout=5)
        )
    assert refused.code() == code, refused.details()
    assert len(lane.mailbox) == 0  # the refused chunk changed nothing
    if why is not None:
        lines = [r.getMessage() for r in caplog.records if why in r.getMessage()]
        assert len(lines) == 1, caplog.text
        assert PEER.search(lines[0]) and "/isthmus.v1.Lane/PushChunks" in lines[0], lines[0]

    # The same server still takes the same chunk from a valid peer.
    with open_channel(clients(job_dir, rogue_dir)["valid"], lane.address) as channel:
        reply = lane_pb2_grpc.LaneStub(channel).PushChunks(iter([chunk()]), timeout=5)
    assert reply.accepted == 1 and len(lane.mailbox) == 1


def test_lane_peer_sends_with_tls_and_token(lane, job_dir):
    # A bare peer has no round to take a bulk ticket: PushChunks (bulk: test_bulk_tls.py).
    peer = LanePeer(lane.address, security=full(job_dir, "site1"), connections=2, transport="grpc")
    try:
        round_ = peer.begin_round(deadline=10**9)
        round_.send(Frame.from_message(chunk().SerializeToString()))
        round_.send(Frame.from_message(chunk(chunk_index=0, step=1).SerializeToString()))
        round_.end()
        assert round_.wait(timeout=10) == 2
        assert len(lane.mailbox) == 2
    finally:
        peer.close()


def test_a_lane_takes_a_sites_chunks_only_from_its_certificate(lane, job_dir):
    """Issue 14, row 9: with a membership set, chunks "from site1" (and ResendChunk for
    what was sent to site1) come only from a certificate naming site1."""
    lane.set_members(Members(1, 0, 2, ("site0", "site1")))
    with open_channel(full(job_dir, "site0"), lane.address) as channel:  # not site1
        stub = lane_pb2_grpc.LaneStub(channel)
        refused = refusal(lambda: stub.PushChunks(iter([chunk()]), timeout=5))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
        # site0's certificate names no peer of site0's lane: no stream at all (issue 33).
        assert "certificate names no peer site of site0" in refused.details()
        ask = lane_pb2.ResendChunkRequest(generation=1, step=0, from_site=1)
        refused = refusal(lambda: stub.ResendChunk(ask, timeout=5))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
        # Nor can it give up site1's rounds in its name (issue 38's AbortRound).
        give_up = lane_pb2.AbortRoundRequest(generation=1, step=0, from_site=1)
        refused = refusal(lambda: stub.AbortRound(give_up, timeout=5))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused.details()
    assert len(lane.mailbox) == 0 and lane.mailbox.aborted(0, 0) is None
    with open_channel(full(job_dir, "site1"), lane.address) as channel:
        reply = lane_pb2_grpc.LaneStub(channel).PushChunks(iter([chunk()]), timeout=5)
    assert reply.accepted == 1 and len(lane.mailbox) == 1


def test_a_client_refuses_a_server_of_another_ca(job_dir, rogue_dir):
    """Mutual: a site does not talk to an impostor that holds another CA's certificate."""
    impostor = LaneServer(
        site_index=0, num_sites=2, codec="raw", generation=1, security=full(rogue_dir, "site0")
    )
    try:
        with full(job_dir, "site1").channel(impostor.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            refused = refusal(lambda: stub.PushChunks(iter([chunk()]), timeout=5))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "handshake" in refused.details().lower()
        assert len(impostor.mailbox) == 0
    finally:
        impostor.stop(0)


def test_token_alone_without_tls(job_dir, caplog):
    """require_token without require_tls: plaintext, but every call needs the token."""
    token_only = SiteSecurity.load(job_dir, "site0", require_token=True)
    server = LaneServer(site_index=0, num_sites=2, codec="raw", generation=1, security=token_only)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            refused = refusal(lambda: stub.PushChunks(iter([chunk()]), timeout=5))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(server.mailbox) == 0
        assert PEER.search(caplog.text)
        # With the token, and the pass site 1's lane is granted (issue 33, row 8).
        site1 = (("isthmus-lane-pass", server.tickets.issue("1").hex()),)
        with token_only.channel(server.address) as channel:
            stub = lane_pb2_grpc.LaneStub(channel)
            assert stub.PushChunks(iter([chunk()]), timeout=5, metadata=site1).accepted
    finally:
        server.stop(0)


# -- the control plane ----------------------------------------------------------------


@pytest.fixture()
def coordinator(job_dir) -> Coordinator:
    coord = Coordinator(
        CoordinatorSettings(
            site="site0",
            site_names=SITES,
            ranks=1,
            fingerprint={"job.name": "t"},
            join_timeout_s=60,
        ),
        peers={"site1": "127.0.0.1:9"},  # never answers; this test talks to site0 only
        security=full(job_dir, "site0"),
        rank_keys=RankKeys("site0", [process_key()]),  # this process plays rank 0
    )
    coord.start()
    yield coord
    coord.stop(0)


def register(channel: grpc.Channel, site: str = "site0", lane: str = "127.0.0.1:1234") -> None:
    """This process registers as rank 0 of ``site`` over ``channel``."""
    cpb_grpc.CoordinatorStub(channel).RegisterRank(
        cpb.RegisterRankRequest(
            site=site,
            rank=0,
            world_size=1,
            lane_address=lane,
            fingerprint=cpb.JobFingerprint(fields={"job.name": "t"}),
            rank_key=process_key(),
        ),
        timeout=5,
    )


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_coordinator_registers_no_rank_for_an_unauthenticated_peer(
    coordinator, job_dir, rogue_dir, kind, caplog
):
    code, why = REFUSED[kind]
    with open_channel(clients(job_dir, rogue_dir)[kind], coordinator.address) as channel:
        refused = refusal(lambda: register(channel))
    assert refused.code() == code, refused.details()
    with open_channel(clients(job_dir, rogue_dir)[kind], coordinator.address) as channel:
        votes = cpb_grpc.CoordinatorStub(channel).HostSession(
            iter([cpb.CommitHostStepRequest()]), timeout=5
        )
        assert refusal(lambda: list(votes)).code() == code  # a stream is gated like a call
    assert coordinator.state.lanes == [None]  # nothing registered
    if why is not None:
        line = next(r.getMessage() for r in caplog.records if why in r.getMessage())
        assert PEER.search(line) and "RegisterRank" in line and "site0" in line, line

    with peer_channel(coordinator.address, security=full(job_dir, "site0")) as channel:
        register(channel)  # a rank of the site, with the site's certificate
    assert coordinator.state.lanes == ["127.0.0.1:1234"]


def test_a_certificate_speaks_only_for_the_site_it_names(coordinator, job_dir, caplog):
    """site1's certificate is valid for the job, but it cannot register a rank of
    site0, nor send heartbeats or votes as site0; as site1 it is heard."""
    site1 = full(job_dir, "site1")
    with peer_channel(coordinator.address, security=site1) as channel:
        stub = cpb_grpc.CoordinatorStub(channel)
        refused = refusal(lambda: register(channel))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "does not name site 'site0'" in refused.details()
        refused = refusal(
            lambda: stub.SiteVote(
                cpb.SiteVoteRequest(site="site0", step=0, generation=1, ok=True), timeout=5
            )
        )
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        votes = cpb.CommitHostStepRequest(site="site0", step=0, generation=1)
        refused = refusal(lambda: list(stub.HostSession(iter([votes]), timeout=5)))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED  # on a stream too
        stub.Heartbeat(cpb.HeartbeatRequest(site="site1"), timeout=5)  # as itself: fine
    assert coordinator.state.lanes == [None]
    line = next(r.getMessage() for r in caplog.records if "does not name" in r.getMessage())
    assert PEER.search(line) and "RegisterRank" in line, line


def test_health_checks_need_tls_but_no_token(coordinator, job_dir):
    request = health_pb2.HealthCheckRequest(service="isthmus.v1.Coordinator")
    no_token = clients(job_dir, job_dir)["no_token"]
    with no_token.channel(coordinator.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(coordinator.address) as channel:
        refused = refusal(lambda: health_pb2_grpc.HealthStub(channel).Check(request, timeout=5))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE


def test_sites_join_and_lanes_stream_over_tls_through_the_wan_proxy(job_dir, monkeypatch):
    """The emulated link's HTTP CONNECT proxy carries TLS end to end between sites."""
    monkeypatch.setenv("no_grpc_proxy", "none.invalid")  # see sim/relay.py
    wan = RelayServer().start()
    coords: list[Coordinator] = []
    lane = peer = None
    try:
        link = wan.add_link("site0-site1", LinkSpec.symmetric(latency_s=0.002))
        url = "http://{}:{}".format
        proxies = {
            "site0": {"site1": url(*link.add_proxy(initiator="a"))},
            "site1": {"site0": url(*link.add_proxy(initiator="b"))},
        }
        for site in SITES:
            coords.append(
                Coordinator(
                    CoordinatorSettings(
                        site=site,
                        site_names=SITES,
                        ranks=1,
                        fingerprint={"job.name": "t"},
                        join_timeout_s=30,
                    ),
                    security=full(job_dir, site),
                    rank_keys=RankKeys(site, [process_key()]),  # this process plays rank 0
                )
            )
        for c in coords:
            c.set_peers({o.site: o.address for o in coords if o is not c}, proxies[c.site])
            c.start()
            with peer_channel(c.address, security=full(job_dir, c.site)) as channel:
                register(channel, c.site, "127.0.0.1:1")
        for c in coords:
            assert [s.name for s in c.wait_ready(30)] == SITES
        joined = link.targets_connected
        assert joined >= 2  # each coordinator dialed the other through the proxy

        lane = LaneServer(
            site_index=0, num_sites=2, codec="raw", generation=1, security=full(job_dir, "site0")
        )
        site1, proxy = full(job_dir, "site1"), proxies["site1"]["site0"]  # PushChunks, as above
        peer = LanePeer(lane.address, proxy=proxy, security=site1, transport="grpc")
        round_ = peer.begin_round(deadline=10**9)
        round_.send(Frame.from_message(chunk().SerializeToString()))
        round_.end()
        assert round_.wait(timeout=10) == 1 and len(lane.mailbox) == 1
        assert link.targets_connected > joined  # the lane went through the proxy too
    finally:
        if peer is not None:
            peer.close()
        if lane is not None:
            lane.stop(0)
        for c in coords:
            c.leave()
        for c in coords:
            c.stop(0)
        wan.close()


# -- config ---------------------------------------------------------------------------


def test_fingerprint_says_whether_security_is_on_but_holds_no_secret(job_dir):
    config = load_config(
        overrides=[
            f"security.certs_dir={job_dir}",
            "security.require_tls=true",
            "security.require_token=true",
        ]
    )
    fingerprint = config.fingerprint()
    assert fingerprint["security.require_tls"] == "True"
    assert fingerprint["security.require_token"] == "True"
    token = (job_dir / "token").read_text().strip()
    text = json.dumps(fingerprint)
    assert token not in text and str(job_dir) not in text
    assert site_security(config.security, "site1").cert == (job_dir / "site1.crt").read_bytes()
    # Without a [security] section: the user's job token, no TLS (tests/deploy/test_job_secret.py).
    default = site_security(load_config().security, "site0")
    assert default is not None and default.require_token and not default.require_tls


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["security.require_tls=true"], "security.require_tls needs security.certs_dir"),
        (["security.require_token=true"], "security.require_token needs"),
        (["security.require_tls=true", "security.certs_dir=/nonexistent"], "/nonexistent/ca.crt"),
        (
            ["security.require_token=true", "security.token_file=/nonexistent/tok"],
            "/nonexistent/tok",
        ),
    ],
)
def test_config_refuses_security_without_its_files(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(overrides=overrides)


def test_a_site_without_its_certificate_is_named(job_dir):
    config = load_config(
        overrides=[f"security.certs_dir={job_dir}", "security.require_tls=true", "topology.sites=3"]
    )
    with pytest.raises(ConfigError, match=re.escape(str(job_dir / "site2.crt"))):
        site_security(config.security, "site2")


# -- isthmus certs ----------------------------------------------------------------------


def test_certs_command_writes_usable_private_files_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "certs"
    result = run_cli("certs", "--out", str(out), "--sites", "a,b", "--host", "10.0.0.5", timeout=60)
    assert result.returncode == 0, result.stderr
    names = {"ca.crt", "ca.key", "a.crt", "a.key", "b.crt", "b.key", "token"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        mode = stat.S_IMODE(os.stat(out / name).st_mode)
        assert mode == (0o600 if name.endswith(".key") or name == "token" else 0o644), name
        assert f"wrote {out / name}" in result.stdout
    assert f'certs_dir = "{out}"' in result.stdout and "require_tls = true" in result.stdout

    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    site = x509.load_pem_x509_certificate((out / "a.crt").read_bytes())
    site.verify_directly_issued_by(ca)  # raises if not signed by the job CA
    san = site.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {TLS_NAME, "a"} <= set(san.get_values_for_type(x509.DNSName))
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert isinstance(site.public_key(), ec.EllipticCurvePublicKey)
    assert len((out / "token").read_text().strip()) >= 32

    before = {name: (out / name).read_bytes() for name in names}
    again = run_cli("certs", "--out", str(out), "--sites", "a,b", timeout=60)
    assert_one_line_error(again, "already holds", "--force")
    assert {name: (out / name).read_bytes() for name in names} == before

    forced = run_cli("certs", "--out", str(out), "--sites", "a,b", "--force", timeout=60)
    assert forced.returncode == 0, forced.stderr
    assert (out / "token").read_bytes() != before["token"]
    assert stat.S_IMODE(os.stat(out / "a.key").st_mode) == 0o600


def test_certs_command_takes_the_sites_from_a_job_config(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[topology]\nsites = 3\n")
    result = run_cli("certs", "--out", str(tmp_path / "c"), "-c", str(job), timeout=60)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in (tmp_path / "c").glob("*.crt")} == {
        "ca.crt",
        "site0.crt",
        "site1.crt",
        "site2.crt",
    }
    # A job with a witness gets the witness's certificate too.
    job.write_text('[topology]\nsites = 2\n[failover]\nwitness = "127.0.0.1:7090"\n')
    result = run_cli("certs", "--out", str(tmp_path / "w"), "-c", str(job), timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "w" / "witness.crt").is_file()


# -- end to end ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_job_with_tls_and_token_ends_with_identical_replicas(job_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "local",
        *("--steps", "3", "--ranks-per-site", "1", "--run-dir", str(run_dir), "--quiet"),
        *("--set", "model.preset=tiny", "--set", "train.seq_len=32"),
        *("--set", "run.tensorboard=false"),
        *("--set", f"security.certs_dir={job_dir}"),
        *("--set", "security.require_tls=true", "--set", "security.require_token=true"),
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["digests"]) == set(SITES)
    assert len(set(summary["digests"].values())) == 1
    assert summary["cross_site_bytes"] > 0
