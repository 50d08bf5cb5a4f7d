"""Topology files: the sites of a job and the emulated link between each pair (TOML;
docs/wan.md, "Topology files", gives the keys and their precedence). The same keys, as
`key=value` or `a_to_b.key=value`, change a live link (`apply_changes`, `isthmus wan set`)."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .impairments import impairment_from_dict
from .spec import DEFAULT_QUEUE_BYTES, FIBER_S_PER_KM, DirectionSpec, LinkSpec
from .trace import at_row, load_trace

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

DIRECTION_KEYS = (
    "distance_km",
    "latency_ms",
    "bandwidth_mbit",
    "per_flow_mbit",
    "queue_kib",
    "impairments",
    "seed",
    "trace",
)
"""Keys of a direction's table (and of a link's or [defaults], which add a_to_b/b_to_a);
`trace` (a CSV file, relative to the topology file's folder) in files only."""
DIRECTIONS = ("a_to_b", "b_to_a")
SITE_NAME = re.compile(r"[A-Za-z0-9_.]+")


@dataclass(kw_only=True, slots=True, frozen=True)
class TopologyLink:
    """The link between sites `a` and `b` (a_to_b = bytes sent by a)."""

    a: str
    b: str
    spec: LinkSpec

    @property
    def name(self) -> str:
        """ "a-b", as in the file and in `isthmus wan set`."""
        return f"{self.a}-{self.b}"


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    """Sites and exactly one link per pair of them."""

    sites: tuple[str, ...]  # in the file's order
    links: tuple[TopologyLink, ...]  # one per unordered pair of sites
    seed: int = 0  # the file's (each link's own seed is derived from it unless set)

    def __post_init__(self) -> None:
        _check_sites(self.sites)
        pairs = [frozenset((link.a, link.b)) for link in self.links]
        for link in self.links:
            if link.a == link.b or {link.a, link.b} - set(self.sites):
                raise ValueError(f"links.{link.name}: both ends must be distinct sites")
            if pairs.count(frozenset((link.a, link.b))) > 1:
                raise ValueError(f"links.{link.name}: the pair {link.a}, {link.b} has two links")
        for i, a in enumerate(self.sites):
            for b in self.sites[i + 1 :]:
                if frozenset((a, b)) not in pairs:
                    raise ValueError(f"links.{a}-{b} is missing and there is no [defaults] table")

    def spec(self, a: str, b: str) -> LinkSpec:
        """The link between `a` and `b`, oriented so that a_to_b is bytes sent by `a`."""
        for link in self.links:
            if (link.a, link.b) == (a, b):
                return link.spec
            if (link.b, link.a) == (a, b):
                return LinkSpec(a_to_b=link.spec.b_to_a, b_to_a=link.spec.a_to_b)
        raise ValueError(f"no link between {a!r} and {b!r}; sites are {', '.join(self.sites)}")


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; ValueError names the file and the key."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"topology file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"topology file {path} is not valid TOML: {exc}") from None
    try:
        return parse_topology(data, Path(path).parent)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def parse_topology(data: dict[str, Any], base: Path = Path(".")) -> Topology:
    """Build a `Topology` from a parsed TOML document (format in the module docstring);
    trace files are read from `base`."""
    _known(data, ("sites", "seed", "defaults", "links"), "the top level")
    sites = _check_sites(data.get("sites"))
    seed = _int("seed", data.get("seed", 0))
    defaults = _table(data.get("defaults"), "defaults")
    _known(defaults, (*DIRECTION_KEYS, *DIRECTIONS), "[defaults]")
    tables = _table(data.get("links"), "links")
    links: list[TopologyLink] = []
    for name, table in tables.items():
        a, sep, b = name.partition("-")
        if not sep or a not in sites or b not in sites:
            raise ValueError(f'links."{name}": name a link "SITE-SITE" with sites from {sites}')
        spec = _link(defaults, table, f"links.{name}", seed, base)
        links.append(TopologyLink(a=a, b=b, spec=spec))
    if data.get("defaults") is not None:
        named = {frozenset((link.a, link.b)) for link in links}
        for i, a in enumerate(sites):
            for b in sites[i + 1 :]:
                if frozenset((a, b)) not in named:
                    spec = _link(defaults, {}, f"{a}-{b}", seed, base)
                    links.append(TopologyLink(a=a, b=b, spec=spec))
    return Topology(sites=tuple(sites), links=tuple(links), seed=seed)


def topology_links(
    topology: Topology, site_names: list[str] | None = None
) -> dict[tuple[str, str], LinkSpec]:
    """{(a, b): spec} for each pair a before b in `site_names` (None: the file's), oriented
    a -> b. Names the file has too are matched by name; otherwise the file's sites are
    taken in order. ValueError when the file names a different number of sites."""
    names = list(topology.sites) if site_names is None else list(site_names)
    if len(names) != len(topology.sites):
        raise ValueError(
            f"the topology names {len(topology.sites)} sites ({', '.join(topology.sites)}), "
            f"the job has {len(names)}"
        )
    by_name = set(names) == set(topology.sites)
    file_name = dict(zip(names, names if by_name else topology.sites, strict=True))
    return {
        (a, b): topology.spec(file_name[a], file_name[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }


def spec_to_table(spec: LinkSpec) -> dict[str, dict[str, Any]]:
    """Both directions of a spec as topology-file tables: {"a_to_b": {...}, "b_to_a": {...}}."""
    out = {}
    for name in DIRECTIONS:
        d: DirectionSpec = getattr(spec, name)
        out[name] = {
            "latency_ms": d.latency_s * 1000.0,
            "bandwidth_mbit": 0.0 if d.unlimited else d.bandwidth_bps / 1e6,
            "per_flow_mbit": d.per_flow_bps / 1e6 if d.flow_capped else 0.0,
            "queue_kib": d.queue_bytes / 1024,
            "impairments": [i.to_dict() for i in d.impairments],
            "seed": d.seed,
        }
    return out


def apply_changes(spec: LinkSpec, changes: dict[str, Any], where: str = "changes") -> LinkSpec:
    """`spec` with topology-file keys changed (a link's, or "a_to_b" / "b_to_a" tables),
    e.g. {"bandwidth_mbit": 50}; ValueError, naming `where`, on a bad key or value."""
    _known(changes, (*DIRECTION_KEYS, *DIRECTIONS), where)
    now = spec_to_table(spec)
    new = {}
    for name in DIRECTIONS:
        table = now[name]
        for layer in (changes, _table(changes.get(name), f"{where}.{name}")):
            if "trace" in layer:
                raise ValueError(f"{where}: a trace is set in a topology file, not on a live link")
            table = _layer(table, layer, f"{where}.{name}")
        seed = _int(f"{where}.seed", table["seed"])
        trace = getattr(spec, name).trace  # replayed on: its rows keep changing their keys
        new[name] = dataclasses.replace(_direction(table, f"{where}.{name}", seed), trace=trace)
    return LinkSpec(**new)


def _link(defaults: dict[str, Any], table: Any, where: str, seed: int, base: Path) -> LinkSpec:
    table = _table(table, where)
    _known(table, (*DIRECTION_KEYS, *DIRECTIONS), where)
    derived_seed = zlib.crc32(f"{seed}/{where}".encode())  # links draw different streams
    directions = {}
    for name in DIRECTIONS:
        merged: dict[str, Any] = {
            "per_flow_mbit": 0,
            "queue_kib": DEFAULT_QUEUE_BYTES // 1024,
            "impairments": [],
        }
        for layer, at in (
            (defaults, "defaults"),
            (_table(defaults.get(name), f"defaults.{name}"), f"defaults.{name}"),
            (table, where),
            (_table(table.get(name), f"{where}.{name}"), f"{where}.{name}"),
        ):
            merged = _layer(merged, layer, at)
        link_seed = _int(f"{where}.seed", merged.get("seed", derived_seed))
        directions[name] = _direction(merged, f"{where}.{name}", link_seed, base)
    return LinkSpec(**directions)


def _layer(base: dict[str, Any], layer: dict[str, Any], where: str) -> dict[str, Any]:
    """`base` updated with `layer`'s direction keys; a latency in `layer` replaces both."""
    _known(layer, (*DIRECTION_KEYS, *DIRECTIONS), where)
    if "distance_km" in layer and "latency_ms" in layer:
        raise ValueError(f"{where}: set distance_km or latency_ms, not both")
    out = dict(base)
    if "distance_km" in layer or "latency_ms" in layer:
        out.pop("distance_km", None)
        out.pop("latency_ms", None)
    out.update({k: v for k, v in layer.items() if k not in DIRECTIONS})
    return out


def _direction(
    table: dict[str, Any], where: str, seed: int, base: Path = Path(".")
) -> DirectionSpec:
    if "distance_km" in table:
        latency_s = _number(f"{where}.distance_km", table["distance_km"]) * FIBER_S_PER_KM
    elif "latency_ms" in table:
        latency_s = _number(f"{where}.latency_ms", table["latency_ms"]) / 1000.0
    else:
        raise ValueError(f"{where}: set distance_km or latency_ms")
    if "bandwidth_mbit" not in table:
        raise ValueError(f"{where}: set bandwidth_mbit (Mbit/s each way; 0 = unlimited)")
    queue_kib = _number(f"{where}.queue_kib", table["queue_kib"])
    items = table["impairments"]
    if not isinstance(items, list):
        raise ValueError(
            f'{where}.impairments must be a list like [{{kind = "loss", rate = 0.001}}]'
        )
    impairments = tuple(
        impairment_from_dict(item, f"{where}.impairments[{i}]") for i, item in enumerate(items)
    )
    spec = DirectionSpec(
        latency_s=latency_s,
        bandwidth_bps=_number(f"{where}.bandwidth_mbit", table["bandwidth_mbit"]) * 1e6,
        per_flow_bps=_number(f"{where}.per_flow_mbit", table.get("per_flow_mbit", 0)) * 1e6,
        queue_bytes=int(queue_kib * 1024),
        impairments=impairments,
        seed=seed,
    )
    if "trace" not in table:
        return spec
    if not isinstance(table["trace"], str):
        raise ValueError(f"{where}.trace must be a CSV file's name, got {table['trace']!r}")
    return at_row(dataclasses.replace(spec, trace=load_trace(base / table["trace"])), 0)


def _check_sites(sites: Any) -> Sequence[str]:
    """`sites` itself, once it is known to be two or more distinct site names."""
    if not isinstance(sites, (list, tuple)) or not all(isinstance(s, str) for s in sites):
        raise ValueError(f'sites must be a list of names like ["east", "west"], got {sites!r}')
    if len(sites) < 2 or len(set(sites)) != len(sites):
        raise ValueError(f"sites must name at least two distinct sites, got {sites!r}")
    for site in sites:
        if not SITE_NAME.fullmatch(site):
            raise ValueError(f"sites: {site!r} is not a name of letters, digits, _ and .")
    return sites


def _known(table: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in keys:
            raise ValueError(f"unknown key {key!r} in {where}; keys there: {', '.join(keys)}")


def _table(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table, got {value!r}")
    return value


def _number(where: str, value: Any) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


def _int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    return value
