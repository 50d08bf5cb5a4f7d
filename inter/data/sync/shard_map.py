"""Pairing the ranks of sites of different sizes by the elements they hold (issue 15).

Inside a site, FSDP2 shards every tensor of a group along its first dimension over
the site's shard ranks (``dp x cp`` of them): with ``W`` of them, rank ``k`` holds
rows ``[k*c, (k+1)*c)`` of a tensor of ``n`` rows, ``c = ceil(n / W)`` (torch.chunk's
rule; the last chunks may be short or empty). Sites of equal size hold the same rows at
the same rank, and a rank's round exchanges its whole flat buffer with the same rank of
every other site. Sites of different sizes do not: a rank of a 2-rank site holds what
two ranks of a 4-rank site hold, and rounding can make the chunks straddle.

So the rows of each tensor are cut at every site's chunk boundaries. Each piece of the
cut is held by exactly one shard rank per site; the pieces held by the same ranks
(one per site) form a *piece* of the group, exchanged as one round among those ranks
only. Every site enumerates the pieces in the same order and lays out a piece's
elements in the same order (tensor by tensor, row by row), so the sums line up element
for element, and every site ends with the same values, whatever its size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GroupShape",
    "Piece",
    "ShardPosition",
    "gather_piece",
    "pieces",
    "scatter_piece",
    "shard_rows",
]

MAX_PIECES = 4096
"""Pieces one group may have; a piece's round is named ``group * MAX_PIECES + key``."""


@dataclass(frozen=True, slots=True)
class GroupShape:
    """What one group's flat buffer holds: its tensors, in order, by their rows."""

    rows: tuple[int, ...]  # each tensor's size along the sharded (first) dimension
    row_elems: tuple[int, ...]
    padded: bool
    """Each tensor's slice is padded to ``ceil(rows / W)`` rows, as in FSDP2's
    reduce-scatter output; otherwise slices are packed (local shards)."""

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.row_elems):
            raise ValueError(f"{len(self.rows)} row counts for {len(self.row_elems)} tensors")
        if any(n < 0 for n in self.rows) or any(e < 1 for e in self.row_elems):
            raise ValueError("rows must be >= 0 and row_elems >= 1")

    def flat_size(self, width: int, index: int) -> int:
        return sum(self.slices(width, index))

    def slices(self, width: int, index: int) -> list[int]:
        """Elements of each tensor's slice in that buffer, in order."""
        sizes = []
        for n, e in zip(self.rows, self.row_elems, strict=True):
            start, end = shard_rows(n, width, index)
            sizes.append((_chunk(n, width) if self.padded else end - start) * e)
        return sizes


@dataclass(frozen=True, slots=True)
class ShardPosition:
    """Where a rank sits in its site, for pairing: its pipeline and tensor-parallel
    coordinates (equal at every site) and its shard index (``dp x cp`` flattened)."""

    pp: int
    tp: int
    pp_index: int
    tp_index: int
    shard_index: int

    def width(self, site_ranks: int) -> int:
        return site_ranks // (self.pp * self.tp)

    def rank_of(self, site_ranks: int, shard: int) -> int:
        """The rank of a site of ``site_ranks`` ranks that holds ``shard`` at this
        rank's pipeline and tensor coordinates (ranks are row-major, tp innermost)."""
        return (self.pp_index * self.width(site_ranks) + shard) * self.tp + self.tp_index


@dataclass(frozen=True, slots=True)
class Piece:
    """One round of a group between sites of different sizes."""

    key: int  # its index among the group's pieces, the same at every site
    holders: tuple[int, ...]  # the shard index holding it at each member site
    runs: tuple[tuple[int, int], ...]
    """``(offset, length)`` of its elements in this rank's flat buffer, in its order."""

    @property
    def numel(self) -> int:
        return sum(length for _, length in self.runs)


def _chunk(n: int, width: int) -> int:
    return -(-n // width)


def shard_rows(n: int, width: int, index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a tensor of ``n`` rows that shard rank ``index`` of
    ``width`` holds (torch.chunk's rule, empty past the end)."""
    if not 0 <= index < width:
        raise ValueError(f"shard index {index} outside width {width}")
    c = _chunk(n, width)
    return min(index * c, n), min((index + 1) * c, n)


def pieces(shape: GroupShape, widths: Sequence[int], me: int, shard: int) -> list[Piece]:
    """The pieces of a group that shard rank ``shard`` of site ``me`` holds, in key
    order; together they cover every element it holds (never padding). ``widths``: the
    shard ranks of each member site, by site index."""
    if not 0 <= me < len(widths) or not 0 <= shard < widths[me]:
        raise ValueError(f"site {me} shard {shard} outside widths {list(widths)}")
    # (holders, tensor, first row, last row) of every cut, in tensor and row order.
    cuts: list[tuple[tuple[int, ...], int, int, int]] = []
    for t, n in enumerate(shape.rows):
        bounds = sorted({min(j * _chunk(n, w), n) for w in widths for j in range(w + 1)})
        for a, b in zip(bounds, bounds[1:], strict=False):
            if b > a:
                cuts.append((tuple(a // _chunk(n, w) for w in widths), t, a, b))
    keys = {h: k for k, h in enumerate(sorted({h for h, *_ in cuts}))}
    if len(keys) > MAX_PIECES:
        raise ValueError(f"{len(keys)} pieces in one group, more than {MAX_PIECES}")
    # Where each tensor's slice starts in this rank's flat buffer.
    offsets = list(itertools.accumulate(shape.slices(widths[me], shard), initial=0))
    runs: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for holders, t, a, b in cuts:
        if holders[me] != shard:
            continue
        e = shape.row_elems[t]
        start, _ = shard_rows(shape.rows[t], widths[me], shard)
        offset, length = offsets[t] + (a - start) * e, (b - a) * e
        own = runs.setdefault(holders, [])
        if own and own[-1][0] + own[-1][1] == offset:
            own[-1] = (own[-1][0], own[-1][1] + length)  # contiguous: one run
        else:
            own.append((offset, length))
    return [
        Piece(keys[h], h, tuple(r)) for h, r in sorted(runs.items(), key=lambda kv: keys[kv[0]])
    ]


def gather_piece(buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's elements of a rank's flat ``buffer``, in the piece's order (a copy)."""
    return torch.cat([buffer[o : o + n] for o, n in piece.runs])


def scatter_piece(buffer: torch.Tensor, piece: Piece, values: torch.Tensor) -> None:
    """Writes a piece's elements back where :func:`gather_piece` took them from."""
    at = 0
    for o, n in piece.runs:
        buffer[o : o + n].copy_(values[at : at + n])
        at += n
