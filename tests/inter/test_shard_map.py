"""Pairing ranks of sites of different sizes by element ranges (inter/data/sync/shard_map.py):
built against FSDP2's own sharding rule (torch.chunk), element by element."""

from __future__ import annotations

import random

import pytest
import torch

from isthmus.inter.data.sync.shard_map import GroupShape, ShardPosition, pieces, shard_rows


def _flat(tensors: list[torch.Tensor], width: int, index: int, padded: bool) -> torch.Tensor:
    """A rank's flat buffer as FSDP2 lays it out: each tensor chunked on dim 0 (empty
    chunks past the end), padded to the first chunk's rows when ``padded``."""
    parts = []
    for t in tensors:
        chunks = list(torch.chunk(t, width, dim=0))
        mine = chunks[index] if index < len(chunks) else t[:0]
        if padded:
            rows = chunks[0].shape[0]
            pad = torch.full((rows - mine.shape[0], *t.shape[1:]), -1, dtype=t.dtype)
            mine = torch.cat([mine, pad])
        parts.append(mine.reshape(-1))
    return torch.cat(parts)


def _tensors(shape: GroupShape) -> list[torch.Tensor]:
    out, at = [], 0
    for n, e in zip(shape.rows, shape.row_elems, strict=True):
        out.append(torch.arange(at, at + n * e).reshape(n, e))
        at += n * e
    return out


CASES = [
    ((4, 2), (6, 8, 1, 5), (3, 1, 7, 2)),
    ((2, 4), (6, 8, 1, 5), (3, 1, 7, 2)),
    ((4, 3), (7, 12, 13, 2), (2, 5, 1, 1)),
    ((1, 3, 2), (5, 9, 4), (1, 2, 3)),
    ((6, 4), (64, 172, 64), (64, 64, 1)),
    ((2, 2), (5, 3), (2, 2)),
]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "packed"])
@pytest.mark.parametrize(("widths", "rows", "row_elems"), CASES)
def test_every_site_lays_out_each_piece_alike_and_covers_what_it_holds(
    widths, rows, row_elems, padded
):
    shape = GroupShape(rows, row_elems, padded)
    tensors = _tensors(shape)
    by_key: dict[int, list[torch.Tensor]] = {}
    holders: dict[int, tuple[int, ...]] = {}
    for site, width in enumerate(widths):
        for shard in range(width):
            flat = _flat(tensors, width, shard, padded)
            assert flat.numel() == shape.flat_size(width, shard)
            mine = pieces(shape, widths, site, shard)
            covered = torch.zeros(flat.numel(), dtype=torch.int64)
            for piece in mine:
                assert piece.holders[site] == shard
                assert holders.setdefault(piece.key, piece.holders) == piece.holders
                values = torch.cat([flat[o : o + n] for o, n in piece.runs])
                assert piece.numel == values.numel()
                by_key.setdefault(piece.key, []).append(values)
                for o, n in piece.runs:
                    covered[o : o + n] += 1
            # Every element it holds is in exactly one piece; padding in none.
            assert torch.equal(covered, (flat >= 0).long())
    for key, seen in by_key.items():
        assert len(seen) == len(widths), f"piece {key} is not held at every site"
        for values in seen[1:]:
            assert torch.equal(values, seen[0])  # the same elements, in the same order
    assert sorted(by_key) == list(range(len(by_key)))


def test_equal_sites_pair_each_rank_with_its_own_index():
    shape = GroupShape((8, 6), (3, 2), padded=True)
    for shard in range(4):
        (piece,) = pieces(shape, [4, 4], 1, shard)
        assert piece.holders == (shard, shard)
        # Both tensors' slices in one run (padding left out: shard 3 holds no row of
        # the 6-row tensor).
        assert piece.runs == ((0, 2 * 3 + (2 * 2 if shard < 3 else 0)),)


def test_a_random_group_pairs_consistently():
    rng = random.Random(7)
    for _ in range(20):
        count = rng.randint(1, 6)
        rows = tuple(rng.randint(0, 30) for _ in range(count))
        elems = tuple(rng.randint(1, 4) for _ in range(count))
        widths = tuple(rng.randint(1, 7) for _ in range(rng.randint(2, 3)))
        test_every_site_lays_out_each_piece_alike_and_covers_what_it_holds(
            widths, rows, elems, rng.random() < 0.5
        )


def test_shard_rows_follow_torch_chunk():
    for n in range(0, 14):
        for width in range(1, 7):
            chunks = torch.chunk(torch.arange(n), width) if n else ()
            for index in range(width):
                start, end = shard_rows(n, width, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(start, end)) == expected


def test_a_rank_is_found_by_its_shard_at_a_site_of_any_size():
    # pp=2, tp=2: a site of 12 ranks has 3 shard ranks per (pp, tp) coordinate.
    pos = ShardPosition(pp=2, tp=2, pp_index=1, tp_index=1, shard_index=0)
    assert pos.width(12) == 3 and pos.width(8) == 2
    assert pos.rank_of(12, 2) == (1 * 3 + 2) * 2 + 1
    assert pos.rank_of(8, 0) == (1 * 2 + 0) * 2 + 1


def test_bad_positions_and_shapes_are_refused():
    shape = GroupShape((4,), (1,), padded=False)
    with pytest.raises(ValueError, match="outside widths"):
        pieces(shape, [2, 4], 0, 2)
    with pytest.raises(ValueError, match="row counts"):
        GroupShape((4, 2), (1,), padded=False)
    with pytest.raises(ValueError, match="outside width"):
        shard_rows(4, 2, 2)
