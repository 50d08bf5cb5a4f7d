"""Egress: the bytes each site sent to each other site, step by step and over the run,
priced by `wan.egress_usd_per_gb` (a link of its own price: `wan.egress_prices`) and set
against `wan.egress_budget_usd` (issue 61; docs/measure.md, "Egress").

A site's bytes are exact (every rank's lane counts what it sent); which peer they went to
is split as rank 0's lane split the bytes its peers acknowledged (its `links`), or evenly
where it has no such figures (gRPC lanes): chunk ownership rotates among the sites, so
each peer gets an even share of a site's rounds."""

from __future__ import annotations

from collections import defaultdict

from isthmus.deploy.config.wan_section import WanSection


def site_egress(line: dict, peers: list[str]) -> dict[str, float]:
    """Bytes one site's metrics line sent to each peer site."""
    sent = line.get("bytes_sent", 0)
    acked = {p: f.get("bytes") or 0 for p, f in line.get("links", {}).items()}
    if total := sum(acked.values()):
        return {p: sent * b / total for p, b in acked.items()}
    return {p: sent / len(peers) for p in peers} if peers else {}


def step_egress(rows: list[dict]) -> dict[str, float]:
    """One step's bytes by link "sender->receiver", from the lines of the sites in it."""
    sites = [r["site"] for r in rows]
    return {
        f"{r['site']}->{peer}": sent
        for r in rows
        for peer, sent in site_egress(r, [s for s in sites if s != r["site"]]).items()
    }


def spend_usd(egress: dict[str, float], wan: WanSection) -> float:
    """What ``egress`` (bytes by "sender->receiver") costs."""
    return sum(b / 1e9 * wan.egress_price(*link.split("->")) for link, b in egress.items())


def egress_summary(steps: list[dict], wan: WanSection) -> dict:
    """summary.json's ``egress``: each link's bytes and price, the total, the budget."""
    links: dict[str, float] = defaultdict(float)
    for r in steps:
        for link, sent in r.get("egress", {}).items():
            links[link] += sent
    if not links:
        return {}
    priced = {k: {"bytes": b, "usd": spend_usd({k: b}, wan)} for k, b in sorted(links.items())}
    out = {"links": priced, "usd": sum(p["usd"] for p in priced.values())}
    if wan.egress_budget_usd:
        out["budget_usd"] = wan.egress_budget_usd
    return {"egress": out}


def egress_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary's line of egress, once it is priced."""
    egress = summary.get("egress", {})
    if not egress.get("usd"):
        return []
    gb = sum(p["bytes"] for p in egress["links"].values()) / 1e9
    budget = egress.get("budget_usd")
    within = "" if budget is None else f" of a ${budget:,.2f} budget"
    return [("egress", f"${egress['usd']:,.4f}{within} for {gb:,.3f} GB across sites")]
