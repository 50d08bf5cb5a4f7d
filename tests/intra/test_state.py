"""A rank's training state as named tensors (intra/state.py), on real gloo groups.

Trainer A trains 3 steps; a fresh trainer B loads A's ``rank_state``; both then
train the same next steps and must hold bitwise-equal parameters: the state is the
whole of what a step depends on (the data position is the step number).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import init_gloo, shutdown, site_trainer, spawn

from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.digest import shard_digest
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.model_config import preset
from isthmus.intra.state import StateError, load_rank_state, rank_state, state_digest
from isthmus.intra.train import TrainConfig, Trainer

SEED, SEQ, BATCH = 3, 16, 2
MODEL = preset("tiny")
CONFIG = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=10)
LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


def _trainer(layout: ParallelLayout) -> tuple[Trainer, ShardedBatches]:
    return site_trainer(MODEL, layout, CONFIG, SEQ, BATCH, SEED)


def _optim_empty(trainer: Trainer) -> bool:
    return all(not trainer.optimizer.state.get(p) for p in trainer.parameters())


def _bad_states(good: dict[str, torch.Tensor]) -> dict[str, tuple[dict, str]]:
    """Broken copies of a state, each with the words its StateError must contain."""
    first = next(n for n in good if n.startswith("model/"))
    last_optim = [n for n in good if n.startswith("optim/")][-1]
    wrong_shape = dict(good, **{first: torch.zeros(good[first].numel() + 1)})
    missing = {n: t for n, t in good.items() if n != last_optim}
    unexpected = dict(good, **{"model/not.a.param": torch.zeros(1)})
    wrong_dtype = dict(good, **{last_optim: good[last_optim].double()})
    return {
        "shape": (wrong_shape, f"{first!r} has shape"),
        "missing": (missing, f"lacks {last_optim!r}"),
        "unexpected": (unexpected, "unexpected state entry 'model/not.a.param'"),
        "dtype": (wrong_dtype, f"{last_optim!r} has dtype torch.float64"),
    }


def _one_layout(layout_kw: dict) -> dict[str, Any]:
    layout = ParallelLayout(**layout_kw)
    a, data = _trainer(layout)
    b, _ = _trainer(layout)
    for step in range(3):
        a.step(step, *data.batch(step))
    residual = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = rank_state(a, 3, extra={"g0/c1": residual})
    out: dict[str, Any] = {"errors": {}}

    # A broken state is refused before anything changes.
    before = shard_digest(b.model_parts)
    for case, (bad, words) in _bad_states(state).items():
        try:
            load_rank_state(b, bad)
        except StateError as exc:
            out["errors"][case] = words in str(exc), str(exc)
        else:
            out["errors"][case] = False, "no StateError"
    out["unchanged"] = shard_digest(b.model_parts) == before and _optim_empty(b)

    next_step, extra = load_rank_state(b, state)
    out["next_step"], out["extra_ok"] = next_step, torch.equal(extra["g0/c1"], residual)
    out["changed"] = shard_digest(b.model_parts) != before
    # Loaded state reads back identically (the copies are not views of A's tensors).
    out["roundtrip"] = state_digest(rank_state(b, 3, extra=extra)) == state_digest(state)
    for step in range(3, 5):
        batch = data.batch(step)
        la, lb = a.step(step, *batch).loss, b.step(step, *batch).loss
        out.setdefault("losses", []).append((la, lb))
    out["shards"] = (shard_digest(a.model_parts), shard_digest(b.model_parts))
    out["digests"] = (a.parameter_digest(), b.parameter_digest())
    return out


def _worker(rank: int, world: int, store: str) -> dict[str, Any]:
    init_gloo(rank, world, store)
    out = {name: _one_layout(kw) for name, kw in LAYOUTS.items()}
    shutdown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp: Path = tmp_path_factory.mktemp("state")
    return spawn(_worker, 2, tmp, 2, str(tmp / "store"), timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaded_state_trains_bitwise_like_the_original(results: list[dict], layout: str) -> None:
    for rank in results:
        r = rank[layout]
        assert r["next_step"] == 3 and r["extra_ok"] and r["roundtrip"] and r["changed"]
        # Bitwise: the same state and the same batches give the same arithmetic.
        assert all(la == lb for la, lb in r["losses"]), r["losses"]
        assert r["shards"][0] == r["shards"][1]
        assert r["digests"][0] == r["digests"][1]
    # The two ranks hold different shards (the test is not vacuous).
    if layout != "pp2":  # pp ranks hold different layers: different digests anyway
        assert results[0][layout]["shards"][0] != results[1][layout]["shards"][0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_mismatched_state_is_refused_and_changes_nothing(
    results: list[dict], layout: str
) -> None:
    for rank in results:
        r = rank[layout]
        for case, (ok, message) in r["errors"].items():
            assert ok, f"{case}: {message}"
        assert r["unchanged"]


def test_state_digest_covers_names_dtypes_and_bytes() -> None:
    a = {"x": torch.zeros(3), "meta/next_step": torch.tensor(1)}
    assert state_digest(a) == state_digest(dict(reversed(list(a.items()))))
    assert state_digest(a) != state_digest({**a, "x": torch.zeros(3, dtype=torch.float64)})
    assert state_digest(a) != state_digest({**a, "x": torch.tensor([0.0, 0.0, 1e-30])})
    assert state_digest(a) != state_digest({"y": torch.zeros(3), "meta/next_step": a["x"][:0]})
