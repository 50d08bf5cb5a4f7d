"""Topology files (parsing, validation, defaults, asymmetry) and the control endpoint."""

from __future__ import annotations

import pytest
from helpers import ROOT

from isthmus.sim import Jitter, LinkSpec, Loss, RelayServer, load_topology, topology_links
from isthmus.sim.control import control_request
from isthmus.sim.topology import apply_changes, parse_topology, spec_to_table

DOCS = ROOT / "docs" / "topologies"


def test_example_two_sites() -> None:
    topology = load_topology(DOCS / "two-sites-1000km.toml")
    assert topology.sites == ("east", "west")
    (link,) = topology.links
    assert link.name == "east-west"
    assert link.spec.rtt_s == pytest.approx(2 * 1000 * 4.9e-6)
    assert link.spec.a_to_b.bandwidth_bps == 1e9
    assert link.spec.a_to_b.queue_bytes == 1024 * 1024
    assert link.spec.a_to_b.impairments == (Jitter(ms=0.5),)


def test_example_triangle_defaults_and_asymmetry() -> None:
    topology = load_topology(DOCS / "three-sites-triangle.toml")
    assert topology.sites == ("us", "eu", "asia")
    assert sorted(link.name for link in topology.links) == ["eu-asia", "us-asia", "us-eu"]
    eu_asia = topology.spec("eu", "asia")
    assert eu_asia.a_to_b.bandwidth_bps == 500e6 and eu_asia.b_to_a.bandwidth_bps == 100e6
    assert eu_asia.b_to_a.impairments == (Jitter(ms=3), Loss(rate=0.001))
    assert eu_asia.a_to_b.impairments == (Jitter(ms=1), Loss(rate=0.0001))  # from [defaults]
    reverse = topology.spec("asia", "eu")  # oriented the other way
    assert reverse.a_to_b == eu_asia.b_to_a
    us_asia = topology.spec("us", "asia")  # not under [links]: all [defaults]
    assert us_asia.a_to_b.latency_s == pytest.approx(6000 * 4.9e-6)
    assert us_asia.a_to_b.bandwidth_bps == 400e6
    # Links draw different random streams unless a seed is set on purpose.
    seeds = {link.spec.a_to_b.seed for link in topology.links}
    assert len(seeds) == 3


def test_topology_links_maps_by_name_or_in_order() -> None:
    topology = load_topology(DOCS / "three-sites-triangle.toml")
    by_name = topology_links(topology)
    assert list(by_name) == [("us", "eu"), ("us", "asia"), ("eu", "asia")]
    positional = topology_links(topology, ["site0", "site1", "site2"])
    assert positional[("site1", "site2")] == by_name[("eu", "asia")]
    with pytest.raises(ValueError, match="names 3 sites"):
        topology_links(topology, ["site0", "site1"])


BASE = {"sites": ["a", "b"], "links": {"a-b": {"latency_ms": 5, "bandwidth_mbit": 100}}}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"colour": 1}, "unknown key 'colour' in the top level"),
        ({"links": {"a-b": {"latency_ms": 5, "bandwidth_mbit": 1, "speed": 3}}}, "'speed'"),
        ({"links": {"a-b": {"latency_ms": 5, "distance_km": 9, "bandwidth_mbit": 1}}}, "not both"),
        ({"links": {"a-b": {"latency_ms": 5}}}, "links.a-b.a_to_b: set bandwidth_mbit"),
        ({"links": {"a-b": {"bandwidth_mbit": 5}}}, "set distance_km or latency_ms"),
        ({"links": {"a-b": {"latency_ms": -1, "bandwidth_mbit": 1}}}, "latency_ms must be"),
        ({"links": {"a-c": {"latency_ms": 1, "bandwidth_mbit": 1}}}, 'links."a-c"'),
        ({"links": {}}, "links.a-b is missing"),
        ({"sites": ["a", "a"]}, "distinct"),
        ({"sites": ["a", "b-c"]}, "not a name"),
        ({"seed": 1.5}, "seed must be an integer"),
        (
            {"links": {"a-b": {"latency_ms": 5, "bandwidth_mbit": 1, "impairments": [{}]}}},
            r"links.a-b.a_to_b.impairments\[0\].kind",
        ),
        (
            {"links": {"a-b": {"latency_ms": 5, "bandwidth_mbit": 1, "b_to_a": {"rate": 1}}}},
            "unknown key 'rate' in links.a-b.b_to_a",
        ),
    ],
)
def test_bad_topologies_fail_naming_the_key(change, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_topology({**BASE, **change})


def test_direction_overrides_replace_latency_and_file_errors_name_the_file(tmp_path) -> None:
    topology = parse_topology(
        {
            "sites": ["a", "b"],
            "links": {
                "a-b": {"distance_km": 100, "bandwidth_mbit": 0, "a_to_b": {"latency_ms": 7}}
            },
        }
    )
    spec = topology.spec("a", "b")
    assert spec.a_to_b.latency_s == pytest.approx(0.007)
    assert spec.b_to_a.latency_s == pytest.approx(100 * 4.9e-6)
    assert spec.a_to_b.unlimited
    bad = tmp_path / "bad.toml"
    bad.write_text('sites = ["a", "b"]\n[links."a-b"]\nlatency_ms = 5\nbandwidth_mbit = 1\nx = 2\n')
    with pytest.raises(ValueError, match=f"{bad}: unknown key 'x'"):
        load_topology(bad)
    bad.write_text("sites = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_topology(bad)


def test_apply_changes_round_trips_and_validates() -> None:
    spec = LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=100e6, seed=3)
    assert apply_changes(spec, {"seed": 3}) == spec  # the tables round-trip exactly
    new = apply_changes(
        spec, {"bandwidth_mbit": 50, "b_to_a": {"impairments": [{"kind": "loss", "rate": 0.01}]}}
    )
    assert new.a_to_b.bandwidth_bps == 50e6 and new.b_to_a.bandwidth_bps == 50e6
    assert new.a_to_b.impairments == () and new.b_to_a.impairments == (Loss(rate=0.01),)
    assert spec_to_table(new)["b_to_a"]["impairments"][0]["kind"] == "loss"
    with pytest.raises(ValueError, match="queue_kib"):
        apply_changes(spec, {"queue_kib": "big"})


@pytest.mark.timeout(20)
def test_control_endpoint_shows_and_changes_links() -> None:
    with RelayServer() as relay:
        link = relay.add_link("a-b", LinkSpec.symmetric(latency_s=0.005, bandwidth_bps=100e6))
        link.add_proxy()
        address = relay.serve_control().address
        shown = control_request(address, "GET", "/links")
        assert shown["a-b"]["spec"]["a_to_b"]["bandwidth_mbit"] == 100
        assert shown["a-b"]["listeners"][0]["kind"] == "proxy"
        answer = control_request(address, "POST", "/links/a-b", {"a_to_b": {"latency_ms": 9}})
        assert answer["spec"]["a_to_b"]["latency_ms"] == pytest.approx(9)
        assert link.spec.a_to_b.latency_s == pytest.approx(0.009)
        before = link.spec
        for body, needle in (
            ({"bandwidth_mbit": -1}, "bandwidth_mbit"),
            ({"impairments": [{"kind": "flap"}]}, "duration_s"),
            ({"nope": 1}, "unknown key 'nope'"),
        ):
            with pytest.raises(ValueError, match=needle):
                control_request(address, "POST", "/links/a-b", body)
        assert link.spec == before  # a refused change changes nothing
        with pytest.raises(ValueError, match="no link named 'x-y'"):
            control_request(address, "GET", "/links/x-y")
    with pytest.raises(ValueError, match="loopback"):
        RelayServer().serve_control(host="0.0.0.0")
