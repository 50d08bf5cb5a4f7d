"""A rank's state cut from the states of the ranks of a site of another size.

A site that rejoins copies the state of a live site (invariant 3). When the two sites
have different data-parallel widths, the rank at one coordinate holds other rows of
each tensor (FSDP2 chunks the first dimension over ``dp x cp`` shard ranks, torch.chunk's
rule), so a joining rank takes, from each source rank whose rows overlap its own, the
rows it holds, and stacks them in order. The outer optimizer's flat anchor and momentum
of a group are cut the same way, parameter by parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .parallel import sharded_rows
from .state import NEXT_STEP, StateError, named_parameters
from .train import Trainer

__all__ = ["chunk_rows", "reshard_state", "source_shards"]

OUTER = "extra/outer/"
_Rows = dict[str, tuple[int, int, int, int]]


def chunk_rows(n: int, width: int, index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of ``n`` that shard ``index`` of ``width`` holds (torch.chunk)."""
    c = -(-n // width)
    return min(index * c, n), min((index + 1) * c, n)


def _rows(trainer: Trainer) -> _Rows:
    """fqn -> (rows, row_elems, shard index, width) (``sharded_rows``)."""
    by_id: dict[int, tuple[int, int, int, int]] = {}
    for part in trainer.model_parts:
        by_id |= sharded_rows(part)
    return {fqn: by_id[id(p)] for fqn, p in named_parameters(trainer)}


def source_shards(trainer: Trainer, source_width: int) -> list[int]:
    """The shard indices of a site of ``source_width`` shard ranks whose rows overlap
    this rank's, in order."""
    needed: set[int] = set()
    for n, _, index, width in _rows(trainer).values():
        a, b = chunk_rows(n, width, index)
        for j in range(source_width):
            lo, hi = chunk_rows(n, source_width, j)
            if max(a, lo) < min(b, hi):
                needed.add(j)
    return sorted(needed) or [0]


def _cut(pieces: list[tuple[torch.Tensor, int, int]], a: int, b: int) -> torch.Tensor:
    """Rows [a, b) from ``(tensor, first row, end row)`` pieces in row order."""
    parts = [
        t[max(a, lo) - lo : min(b, hi) - lo] for t, lo, hi in pieces if max(a, lo) < min(b, hi)
    ]
    if not parts:  # this rank holds no row: an empty slice of the right trailing shape
        return pieces[0][0][:0].clone()
    return torch.cat(parts).contiguous()


def reshard_state(
    trainer: Trainer,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    source_width: int,
    outer_groups: Sequence[Sequence[str]] = (),
) -> dict[str, torch.Tensor]:
    """This rank's state from ``sources`` (shard index -> ``rank_state``, at least those
    :func:`source_shards` names) of a site of ``source_width`` (dp x cp) shard ranks;
    ``outer_groups``: each outer sync group's parameter names, in order. Codec residuals
    are left out: they belong to the source's lanes, whose rounds were cut otherwise.
    StateError where a source or an entry is missing.
    """
    missing = [j for j in source_shards(trainer, source_width) if j not in sources]
    if missing:
        raise StateError(f"no state from source shards {missing}")
    rows = _rows(trainer)
    first = sources[min(sources)]

    def gather(name: str, fqn: str, group: Sequence[str] | None = None) -> torch.Tensor:
        n, row_elems, index, width = rows[fqn]
        pieces = []
        for j in sorted(sources):
            if name not in sources[j]:
                raise StateError(f"source shard {j} lacks {name!r}")
            lo, hi = chunk_rows(n, source_width, j)
            t = sources[j][name]
            if group is not None:  # the parameter's rows in the group's packed flat
                offset = _offset(rows, group, fqn, source_width, j)
                t = t[offset : offset + (hi - lo) * row_elems].view(hi - lo, row_elems)
            pieces.append((t, lo, hi))
        return _cut(pieces, *chunk_rows(n, width, index))

    out: dict[str, torch.Tensor] = {}
    for fqn in rows:
        for name in (f"model/{fqn}", f"optim/{fqn}/exp_avg", f"optim/{fqn}/exp_avg_sq"):
            out[name] = gather(name, fqn)
        out[f"optim/{fqn}/step"] = first[f"optim/{fqn}/step"].clone()
    for name in ("rng/cpu", "rng/cuda", NEXT_STEP):
        if name in first:
            out[name] = first[name].clone()
    for i, group in enumerate(outer_groups):
        for kind in ("anchor", "momentum"):
            name = f"{OUTER}{kind}/{i}"
            per_param = [gather(name, fqn, group).reshape(-1) for fqn in group]
            out[name] = torch.cat(per_param) if per_param else torch.zeros(0)
    return out


def _offset(rows: _Rows, group: Sequence[str], fqn: str, width: int, index: int) -> int:
    """Where ``fqn``'s rows start in the packed flat of ``group`` at shard ``index``."""
    at = 0
    for name in group:
        if name == fqn:
            return at
        n, row_elems, _, _ = rows[name]
        lo, hi = chunk_rows(n, width, index)
        at += (hi - lo) * row_elems
    raise StateError(f"{fqn!r} is not in its outer group")
