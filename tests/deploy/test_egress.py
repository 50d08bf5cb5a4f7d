"""Egress by link, priced, against a budget (deploy/reports/egress.py), and its keys."""

from __future__ import annotations

import pytest

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.reports.egress import egress_rows, egress_summary, site_egress, step_egress


def test_a_sites_bytes_go_to_its_peers_as_its_lane_saw_them_or_evenly() -> None:
    watched = {"bytes_sent": 900, "links": {"b": {"bytes": 100}, "c": {"bytes": 200}}}
    assert site_egress(watched, ["b", "c"]) == {"b": 300, "c": 600}
    grpc = {"bytes_sent": 900, "links": {"b": {"bytes": None}, "c": {"bytes": None}}}
    assert site_egress(grpc, ["b", "c"]) == {"b": 450, "c": 450}
    assert site_egress({"bytes_sent": 5}, []) == {}
    rows = [{"site": "a", "bytes_sent": 10}, {"site": "b", "bytes_sent": 30}]
    assert step_egress(rows) == {"a->b": 10, "b->a": 30}


def test_each_link_is_priced_at_its_own_price_or_the_jobs() -> None:
    wan = load_config(
        None,
        [
            "topology.sites=3",
            "wan.egress_usd_per_gb=0.02",
            "wan.egress_prices.site2-site0=0.09",
            "wan.egress_budget_usd=5",
        ],
    ).wan
    steps = [{"egress": {"site0->site1": 1e9, "site0->site2": 2e9}}] * 2
    egress = egress_summary(steps, wan)["egress"]
    assert egress["links"]["site0->site1"] == {"bytes": 2e9, "usd": pytest.approx(0.04)}
    assert egress["links"]["site0->site2"]["usd"] == pytest.approx(0.36)
    assert egress["usd"] == pytest.approx(0.40) and egress["budget_usd"] == 5
    assert egress_rows({"egress": egress}) == [
        ("egress", "$0.4000 of a $5.00 budget for 6.000 GB across sites")
    ]
    assert egress_summary([{"egress": {}}], wan) == {}


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("wan.egress_prices.site0-site7=0.1", "name a link A-B of two sites of site0, site1"),
        ("wan.egress_prices.site0-site0=0.1", "name a link A-B of two sites"),
        ("wan.egress_prices.site0-site1=-1", "priced >= 0 USD per GB"),
        ("wan.egress_prices.site0-site1=cheap", "must be float, got 'cheap'"),
        ("wan.egress_budget_usd=-2", "wan.egress_budget_usd must be >= 0"),
    ],
)
def test_bad_egress_settings_are_refused_in_one_line(setting: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why.replace("$", r"\$")):
        load_config(None, [setting])
