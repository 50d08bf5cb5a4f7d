"""Impairments of a link direction, chained in order (like toxiproxy's toxics).

Each is a frozen dataclass of parameters with units (see its module); a direction
applies its chain to every piece of bytes that enters it, with one `random.Random`
per impairment seeded from the link's seed, so a run is reproducible. Build one from
a topology-file table with `impairment_from_dict`."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Impairment, Piece, State
from .corrupt import Corrupt
from .flap import Flap
from .flow_stall import FlowStall
from .jitter import Jitter
from .loss import Loss
from .reset import Reset
from .slice import Slice

KINDS: dict[str, type[Impairment]] = {
    cls.kind: cls for cls in (Jitter, Loss, Flap, FlowStall, Reset, Corrupt, Slice)
}
"""Impairment classes by their `kind` name."""

__all__ = [
    "KINDS",
    "Corrupt",
    "Flap",
    "FlowStall",
    "Impairment",
    "Jitter",
    "Loss",
    "Piece",
    "Reset",
    "Slice",
    "State",
    "impairment_from_dict",
]


def impairment_from_dict(table: dict[str, Any], where: str = "impairment") -> Impairment:
    """Build an impairment from a topology file's `{kind = "...", param = value, ...}`;
    ValueError, naming `where`, on an unknown kind or key, or a bad value."""
    if not isinstance(table, dict):
        raise ValueError(f'{where} must be a table like {{kind = "jitter", ms = 2}}, got {table!r}')
    params = dict(table)
    kind = params.pop("kind", None)
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in known:
            raise ValueError(
                f"{where}: unknown key {key!r} for kind {kind!r}; keys: {', '.join(known)}"
            )
    try:
        return cls(**params)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
