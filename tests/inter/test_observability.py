"""Health checks, Prometheus metrics and replica digests served by a coordinator."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import register_rank, wait_until

from isthmus.inter.control.coordinator import Coordinator, CoordinatorSettings
from isthmus.inter.control.rank_keys import RankKeys, process_key
from isthmus.inter.security import TOKEN_HEADER
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)
FP = {"job.seed": "0"}
D1, D2 = "a" * 64, "b" * 64


def scrape(address: str) -> dict[str, float]:
    """The metrics page as {"name{labels}": value}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def report(coord: Coordinator, **fields) -> pb.ReportProgressResponse:
    with grpc.insecure_channel(coord.address) as channel:
        return pb_grpc.CoordinatorStub(channel).ReportProgress(
            pb.ReportProgressRequest(site=coord.site, rank_key=process_key(), **fields), timeout=5
        )


def register_ranks(coords: list[Coordinator]) -> None:
    """This test process as rank 0 of each site (its votes and reports carry process_key())."""
    for c in coords:
        register_rank(c.address, c.site, FP, key=process_key())


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            .status
        )


def pair_of_coordinators() -> list[Coordinator]:
    """Two started coordinators, site0 and site1, each other's peers."""
    coords = [
        Coordinator(
            CoordinatorSettings(
                site=name,
                site_names=["site0", "site1"],
                ranks=1,
                fingerprint=FP,
                heartbeat_s=0.1,
                metrics_port=0,
            ),
            rank_keys=RankKeys(name, [process_key()]),  # this process plays rank 0 (StepReporter)
        )
        for name in ("site0", "site1")
    ]
    coords[0].set_peers({"site1": coords[1].address})
    coords[1].set_peers({"site0": coords[0].address})
    for c in coords:
        c.start()
    return coords


@pytest.fixture
def pair():
    coords = pair_of_coordinators()
    yield coords
    for c in coords:
        c.stop()


def test_health_is_serving_then_not_serving_when_the_site_drains(pair):
    coord = pair[0]
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(coord.address) == serving
    assert health_status(coord.address, "isthmus.v1.Coordinator") == serving
    coord.drain()
    assert health_status(coord.address) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_prometheus_values_match_the_reported_step(pair):
    line = {
        "step": 7,
        "loss": 3.25,
        "step_s": 0.5,
        "compute_s": 0.4,
        "cross_site_s": 0.1,
        "tokens": 2048,
        "cross_site_bytes": 1000,
        "raw_bytes": 1100,
        "mfu": 0.31,
        "sync_busy_s": 0.2,
    }
    register_ranks(pair)
    report(pair[0], **line)
    link = {"peer": "site1", "bytes": 5000, "wire_s": 0.01, "rate_bps": 4e6, "line_share": 0.5}
    link |= {"rtt_s": 0.02, "min_rtt_s": 0.01, "cwnd_bytes": 65536, "retransmits": 3}
    links = [pb.LinkFigures(**link)]
    report(pair[0], **{**line, "step": 8}, script_metrics={"accuracy": 0.75}, links=links)
    values = scrape(pair[0].metrics_address)
    label = '{site="site0"}'
    by_peer = '{peer="site1",site="site0"}'
    assert values[f"isthmus_link_rate_bits_per_second{by_peer}"] == 4e6
    assert values[f"isthmus_link_line_share_ratio{by_peer}"] == 0.5
    assert values[f"isthmus_link_rtt_seconds{by_peer}"] == 0.02
    assert values[f"isthmus_link_min_rtt_seconds{by_peer}"] == 0.01
    assert values[f"isthmus_link_cwnd_bytes{by_peer}"] == 65536
    assert values[f"isthmus_link_bytes_total{by_peer}"] == 5000
    assert values[f"isthmus_link_retransmits_total{by_peer}"] == 3
    assert values['isthmus_script_metric{name="accuracy",site="site0"}'] == 0.75
    assert values[f"isthmus_step{label}"] == 8
    assert values[f"isthmus_loss{label}"] == 3.25
    assert values[f"isthmus_cross_site_seconds{label}"] == pytest.approx(0.1)
    assert values[f"isthmus_tokens_per_second{label}"] == pytest.approx(2048 / 0.5)
    assert values[f"isthmus_compression_ratio{label}"] == pytest.approx(1.1)
    assert values[f"isthmus_wan_goodput_bytes_per_second{label}"] == pytest.approx(1100 / 0.2)
    assert values[f"isthmus_mfu_ratio{label}"] == pytest.approx(0.31)
    assert values[f"isthmus_tokens_total{label}"] == 4096
    assert values[f"isthmus_cross_site_bytes_total{label}"] == 2000


def test_sites_compare_digests_and_say_when_they_differ(pair):
    register_ranks(pair)
    for c in pair:
        c.wait_ready(10)
    assert report(pair[0], step=10, digest=D1, digest_step=10).divergence == ""
    report(pair[1], step=10, digest=D1, digest_step=10)
    agreed = lambda: pair[0].replicas.agree_at(10, ["site0", "site1"])  # noqa: E731
    wait_until(lambda: agreed() is not None, "peer digest never arrived by heartbeat")
    assert pair[0].replicas.agree_at(10, ["site0", "site1"]) is True
    # site1 now reports a different digest for step 20: both sides learn of it.
    report(pair[0], step=20, digest=D1, digest_step=20)
    report(pair[1], step=20, digest=D2, digest_step=20)
    wait_until(lambda: pair[0].replicas.divergence, "divergence never detected")
    assert "replicas differ after step 20" in report(pair[0], step=21).divergence
    assert scrape(pair[0].metrics_address)['isthmus_replicas_identical{site="site0"}'] == 0
    assert scrape(pair[0].metrics_address)['isthmus_site_up{peer="site1",site="site0"}'] == 1


def test_a_site_admitted_at_the_last_commit_reports_its_final_digest(pair):
    """A site whose pulled state is after the last step trains nothing; its ranks still
    hand the final digest to its coordinator, and the peers see it."""
    from isthmus.deploy.rank.reporting import StepReporter

    register_ranks(pair)
    reporter = StepReporter("site1", Path("/dev/null"), pair[1].address)
    try:
        reporter.report_final_digest(30, D1)
    finally:
        reporter.close()
    assert pair[1].finished and pair[1].replicas.latest()["site1"] == (30, D1)


def test_malformed_reports_are_refused_and_change_nothing(pair):
    with pytest.raises(grpc.RpcError) as info:
        report(pair[0], step=3, digest="not-hex", digest_step=3)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(pair[0].address) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.CoordinatorStub(channel).ReportProgress(
            pb.ReportProgressRequest(site="site1", step=3), timeout=5
        )
    register_ranks(pair)
    for bad in ({"bad name": 1.0}, {"x": math.nan}, {f"m{i}": 0.0 for i in range(33)}):
        with pytest.raises(grpc.RpcError) as info:
            report(pair[0], step=3, script_metrics=bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for links in (
        [pb.LinkFigures(peer="site1", rtt_s=math.nan)],
        [pb.LinkFigures(peer="site1", wire_s=-1.0)],
        [pb.LinkFigures(peer="")],
        [pb.LinkFigures(peer=f"s{i}") for i in range(65)],
    ):
        with pytest.raises(grpc.RpcError) as info:
            report(pair[0], step=3, links=links)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:  # a layout only with a starting digest
        report(pair[0], step=3, digest=D1, digest_step=3, model_layout="w (1,) float32")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pair[0].step == 0
    assert json.dumps(pair[0].replicas.latest()) == "{}"
    assert not any("isthmus_script_metric" in k for k in scrape(pair[0].metrics_address))
    assert not any("isthmus_link" in k for k in scrape(pair[0].metrics_address))


def test_sites_agree_on_their_start_or_name_the_parameter_that_differs(pair):
    """Issue 60: before step 0 each site's ranks report the digest and layout of the
    parameters they start from and wait for `agreed`; a peer's layout comes from its
    own heartbeat answer, and the divergence names the parameter."""
    register_ranks(pair)
    for c in pair:
        c.wait_ready(10)
    layout = "0.weight (8, 4) float32\n0.bias (8,) float32"
    start = {"step": 0, "digest": D1, "digest_step": 0, "model_layout": layout}
    assert not report(pair[0], **start).agreed  # site1 has not said yet
    report(pair[1], **start)
    wait_until(lambda: report(pair[0], **start).agreed, "the sites never agreed on the start")

    other = pair_of_coordinators()
    try:
        register_ranks(other)
        for c in other:
            c.wait_ready(10)
        report(other[0], **start)
        theirs = {**start, "digest": D2, "model_layout": layout.replace("(8,)", "(16,)")}
        report(other[1], **theirs)
        said = lambda: report(other[0], **start).divergence  # noqa: E731
        wait_until(said, "the different start was never found")
        assert said().startswith(
            "the sites build different models: parameter '0.bias' is (8,) float32 at site0 "
            "and (16,) float32 at site1"
        ), said()
        assert not report(other[0], **start).agreed
    finally:
        for c in other:
            c.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_live_job_serves_health_and_metrics_that_match_metrics_jsonl(tmp_path):
    import subprocess

    from helpers import ISTHMUS

    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        [*ISTHMUS, "local", "--steps", "400", "--quiet", "--run-dir", str(run_dir),
         "--set", "model.preset=tiny", "--set", "train.seq_len=32"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines_path = run_dir / "sites" / "site0" / "metrics.jsonl"

        def stepped() -> bool:
            assert job.poll() is None, job.communicate()[1][-2000:]
            return lines_path.exists() and len(lines_path.read_text().splitlines()) >= 3

        wait_until(stepped, "no steps", timeout_s=120)
        addresses = json.loads((run_dir / "job.json").read_text())
        coordinator = addresses["coordinators"]["site0"]
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health_status(coordinator, "isthmus.v1.Coordinator") == serving
        # A local job makes a token for itself: a call without it is refused.
        token = Path(addresses["token_file"]).read_text().strip()
        ask = pb.GetMembershipRequest(known_generation=0, wait_ms=1000)
        with grpc.insecure_channel(coordinator) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetMembership(ask, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            membership = stub.GetMembership(ask, timeout=10, metadata=[(TOKEN_HEADER, token)])
        lane = membership.sites[1].lane_addresses[0]
        assert health_status(lane, "isthmus.v1.Lane") == serving
        # A scrape names a step; the metrics.jsonl line of that step holds the same values.
        # (A scrape taken while rank 0's report is being applied can mix two steps, so
        # the first one that is consistent is compared.)
        for _ in range(10):
            values = scrape(addresses["metrics"]["site0"])
            step = int(values['isthmus_step{site="site0"}'])
            line = json.loads(lines_path.read_text().splitlines()[step - 1])
            if values['isthmus_loss{site="site0"}'] == line["loss"]:
                break
        assert line["step"] == step - 1
        assert values['isthmus_loss{site="site0"}'] == line["loss"]
        assert values['isthmus_cross_site_seconds{site="site0"}'] == pytest.approx(line["sync_s"])
        # The gauge is the exposed sync: the step's wait, which LaneGradientSync measures
        # too, inside the trainer's timing of finish(): nested, so never longer and never
        # zero (a wait left unmeasured). How much shorter is up to the scheduler on a
        # loaded machine (a fixed 0.05 s was), so not asserted.
        assert 0 < line["exposed_sync_s"] <= line["sync_s"], line
        assert line["sync_busy_s"] > 0
        assert values['isthmus_compression_ratio{site="site0"}'] == pytest.approx(
            line["raw_bytes"] / line["bytes_sent"]
        )
        assert values['isthmus_site_up{peer="site1",site="site0"}'] == 1
        # The lane's link to site1, as metrics.jsonl's line of the same step has it.
        link, by_peer = line["links"]["site1"], '{peer="site1",site="site0"}'
        assert values[f"isthmus_link_bytes_total{by_peer}"] >= link["bytes"] > 0
        if link["rtt_ms"]:
            assert values[f"isthmus_link_rtt_seconds{by_peer}"] == pytest.approx(
                link["rtt_ms"] / 1e3
            )
    finally:
        job.terminate()
        job.wait(30)
