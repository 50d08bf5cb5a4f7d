"""The data plane: lanes, rounds, the cross-site all-reduce, codecs, state transfer.

What the rest of isthmus uses of it is named here, and deploy imports nothing else
(tests/deploy/test_layers.py): a rank opens its cross-site sync with one call,
:func:`open_rank_sync` (inter/data/sync/rank.py), and its trainer calls the
:class:`LaneGradientSync` that comes with it; the job's config checks its codec and
sizes its chunks with the helpers below. The names load on first use, so a command
that only reads the config does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isthmus.inter.data.codecs.chain import crc32, make_codec
    from isthmus.inter.data.codecs.int8 import BLOCK as INT8_BLOCK
    from isthmus.inter.data.codecs.spec import CODEC_FORMAT, parse_codec_spec
    from isthmus.inter.data.round.context import ModelMismatch, NonFiniteGradient
    from isthmus.inter.data.state.transfer import ExpectedState
    from isthmus.inter.data.sync.gradient import LaneGradientSync
    from isthmus.inter.data.sync.membership import Generation, QuorumLost
    from isthmus.inter.data.sync.rank import RankSync, RankSyncSettings, open_rank_sync
    from isthmus.inter.data.sync.shard_map import GroupShape, ShardPosition
    from isthmus.inter.data.sync.stats import StepOutcome, SyncStats
    from isthmus.inter.data.transport.chunk_size import (
        connections_for_link,
        descriptors_needed,
        sync_chunk_bytes,
    )

_MODULES = {  # under isthmus.inter.data: the names each exports here
    # A rank's cross-site sync and what a step's outcome carries.
    "sync.rank": ("open_rank_sync", "RankSync", "RankSyncSettings"),
    "sync.membership": ("Generation", "QuorumLost"),
    "sync.gradient": ("LaneGradientSync",),
    "sync.stats": ("StepOutcome", "SyncStats"),
    "round.context": ("ModelMismatch", "NonFiniteGradient"),
    # What a joining rank expects to pull (it bounds what the source may make it allocate).
    "state.transfer": ("ExpectedState",),
    # Where a rank's shards sit, for sites of different sizes.
    "sync.shard_map": ("GroupShape", "ShardPosition"),
    # Codecs and chunk sizes, for the job's config, its plan and its checks.
    "codecs.chain": ("make_codec", "crc32"),
    "codecs.spec": ("parse_codec_spec", "CODEC_FORMAT"),
    "transport.chunk_size": ("connections_for_link", "descriptors_needed", "sync_chunk_bytes"),
}
_EXPORTS = {name: (module, name) for module, names in _MODULES.items() for name in names}
_EXPORTS["INT8_BLOCK"] = ("codecs.int8", "BLOCK")

__all__ = [
    "CODEC_FORMAT",
    "ExpectedState",
    "Generation",
    "GroupShape",
    "INT8_BLOCK",
    "LaneGradientSync",
    "ModelMismatch",
    "NonFiniteGradient",
    "QuorumLost",
    "RankSync",
    "RankSyncSettings",
    "ShardPosition",
    "StepOutcome",
    "SyncStats",
    "connections_for_link",
    "crc32",
    "descriptors_needed",
    "make_codec",
    "open_rank_sync",
    "parse_codec_spec",
    "sync_chunk_bytes",
]


def __getattr__(name: str) -> Any:
    """Loads an exported name's module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value  # once loaded, a plain attribute
    return value
