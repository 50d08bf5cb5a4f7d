"""Atomic per-site checkpoints (intra/checkpoint.py) on real gloo groups, a save
SIGKILLed halfway, and the completeness rules of ``latest``."""

from __future__ import annotations

import errno
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import init_gloo, process, shutdown, site_trainer, spawn
from helpers import fake_checkpoint

from isthmus.intra import checkpoint
from isthmus.intra.checkpoint_failures import FileNamingFileSystem, describe_os_error
from isthmus.intra.corpus.batches import ShardedBatches
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.model import build_model
from isthmus.intra.model_config import ModelConfig, preset
from isthmus.intra.state import rank_state, state_digest
from isthmus.intra.train import TrainConfig, Trainer

SEED, SEQ, BATCH = 11, 16, 2
CONFIG = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=10)


# A head tied to the embedding: with pp=2 each end stage holds a copy of that weight
# (intra/tied.py), and the checkpoint holds it once.
TIED = replace(preset("tiny"), tie_embeddings=True)


def _trainer(
    layout: ParallelLayout, model: ModelConfig | None = None
) -> tuple[Trainer, ShardedBatches]:
    return site_trainer(model or preset("tiny"), layout, CONFIG, SEQ, BATCH, SEED)


def _residual(rank: int) -> dict[str, torch.Tensor]:
    # Per-rank extra entries under one name: DCP must not merge them across ranks.
    return {"codec/g0/c0": torch.full((5,), float(rank) + 0.5)}


def _roundtrip_one(rank: int, root: Path, layout_kw: dict, model: ModelConfig) -> dict[str, Any]:
    layout = ParallelLayout(**layout_kw)
    a, data = _trainer(layout, model)
    for step in range(3):
        a.step(step, *data.batch(step))
        checkpoint.save(a, root, step + 1, _residual(rank), keep=2)
    at_3 = state_digest(rank_state(a, 3, _residual(rank)))
    for step in range(3, 5):
        a.step(step, *data.batch(step))
    b, _ = _trainer(layout, model)
    path = checkpoint.latest(root)
    next_step, extra = checkpoint.load(b, path)
    out = {
        "path": path.name,
        "kept": sorted(p.name for p in root.iterdir()),
        "next_step": next_step,
        "extra_ok": torch.equal(extra["codec/g0/c0"], _residual(rank)["codec/g0/c0"]),
        "state_equal": state_digest(rank_state(b, next_step, extra)) == at_3,
    }
    for step in range(3, 5):
        b.step(step, *data.batch(step))
    out["digests"] = (a.parameter_digest(), b.parameter_digest())
    dist.barrier()
    return out


def _roundtrip_worker(rank: int, world: int, store: str, root: str) -> dict[str, Any]:
    init_gloo(rank, world, store)
    layouts = {"dp2": ({"dp": 2}, preset("tiny")), "pp2-tied": ({"pp": 2}, TIED)}
    out = {name: _roundtrip_one(rank, Path(root) / name, *case) for name, case in layouts.items()}
    shutdown()
    return out


def test_save_latest_load_resumes_bitwise_and_keeps_the_newest(tmp_path: Path) -> None:
    results = spawn(_roundtrip_worker, 2, tmp_path, 2, str(tmp_path / "store"), str(tmp_path))
    for layout in ("dp2", "pp2-tied"):
        for rank in results:
            r = rank[layout]
            assert r["path"] == "step-00000003"
            # keep=2: step 1 was deleted only after step 3 was committed.
            assert r["kept"] == ["step-00000002", "step-00000003"]
            assert r["next_step"] == 3 and r["extra_ok"] and r["state_equal"]
            assert r["digests"][0] == r["digests"][1]
        manifest = json.loads((tmp_path / layout / "step-00000003" / "manifest.json").read_text())
        assert manifest["next_step"] == 3 and manifest["world_size"] == 2
    # One logical weight: the tied model's parameters by their one-process names.
    saved = checkpoint.full_parameters(tmp_path / "pp2-tied" / "step-00000003")
    assert sorted(saved) == sorted(n for n, _ in build_model(TIED, SEED).named_parameters())


# -- verified by content ------------------------------------------------------------


def _flip(path: Path, at: int = 40) -> bytes:
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[at % len(data)] ^= 0x01
    path.write_bytes(bytes(data))
    return original


def _refusal(trainer: Trainer, path: Path, key: bytes | None) -> str:
    try:
        checkpoint.load(trainer, path, key)
    except checkpoint.CheckpointError as exc:
        return str(exc)
    return ""


def _verify_worker(rank: int, world: int, store: str, root: str) -> dict[str, Any]:
    init_gloo(rank, world, store)
    root, key = Path(root), b"t" * 32
    a, data = _trainer(ParallelLayout(dp=2))
    for step in range(4):
        a.step(step, *data.batch(step))
        # Step 1 is the newest step every site holds: pruning passes it by.
        checkpoint.save(a, root, step + 1, keep=2, protect=1, key=key)
    b, _ = _trainer(ParallelLayout(dp=2))
    fresh = state_digest(rank_state(b, 0))
    path = root / "step-00000004"
    out: dict[str, Any] = {"kept": sorted(p.name for p in root.iterdir())}
    out["other key"] = _refusal(b, path, b"u" * 32)
    for name in ("__1_0.distcp", ".metadata"):
        original = _flip(path / name) if rank == 0 else b""
        dist.barrier()
        out[name] = _refusal(b, path, key)
        dist.barrier()
        if rank == 0:
            (path / name).write_bytes(original)
    out["untouched"] = state_digest(rank_state(b, 0)) == fresh
    out["next_step"] = checkpoint.load(b, path, key)[0]
    out["unsigned ok"] = checkpoint.load(b, path, None)[0] == 4
    out["equal"] = state_digest(rank_state(b, 4)) == state_digest(rank_state(a, 4))
    shutdown()
    return out


def test_a_changed_byte_or_a_foreign_key_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Issue 14, rows 5 and 14: a flipped byte in a weight file loaded silently (loss NaN
    at every site); one in DCP's pickled .metadata failed deep inside torch."""
    results = spawn(_verify_worker, 2, tmp_path, 2, str(tmp_path / "store"), str(tmp_path / "c"))
    for r in results:
        assert r["kept"] == ["step-00000001", "step-00000003", "step-00000004"]
        assert "signature does not match the job token" in r["other key"]
        assert "__1_0.distcp does not match its SHA-256" in r["__1_0.distcp"]
        assert ".metadata does not match its SHA-256" in r[".metadata"]
        assert "step-00000004" in r[".metadata"]
        assert r["untouched"] and r["next_step"] == 4 and r["unsigned ok"] and r["equal"]


# -- a save killed halfway --------------------------------------------------------


def _crash_worker(rank: int, world: int, store: str, root: str, record: str) -> None:
    init_gloo(rank, world, store)
    trainer, data = _trainer(ParallelLayout(dp=2))
    for step in range(2):
        trainer.step(step, *data.batch(step))
    checkpoint.save(trainer, Path(root), 2, _residual(rank))
    torch.save(state_digest(rank_state(trainer, 2, _residual(rank))), f"{record}{rank}.pt")
    for step in range(2, 4):
        trainer.step(step, *data.batch(step))
    # The next save writes its data files, then stalls before DCP's .metadata,
    # the manifest and the rename: the test SIGKILLs it there.
    write_data = dcp_writer().write_data

    def slow_write_data(self, plan, planner):
        future = write_data(self, plan, planner)
        future.wait()
        time.sleep(300)
        return future

    dcp_writer().write_data = slow_write_data
    checkpoint.save(trainer, Path(root), 4, _residual(rank))


def dcp_writer() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter


def _load_worker(rank: int, world: int, store: str, root: str) -> dict[str, Any]:
    init_gloo(rank, world, store)
    trainer, _ = _trainer(ParallelLayout(dp=2))
    path = checkpoint.latest(Path(root))
    next_step, extra = checkpoint.load(trainer, path)
    digest = state_digest(rank_state(trainer, next_step, extra))
    shutdown()
    return {"path": path.name, "digest": digest}


@pytest.mark.timeout(180)
def test_a_save_killed_midway_leaves_the_previous_checkpoint_usable(tmp_path: Path) -> None:
    root, record = tmp_path / "ckpt", str(tmp_path / "digest-")
    args = (2, str(tmp_path / "store"), str(root), record)
    procs = [process(_crash_worker, r, *args) for r in range(2)]
    for p in procs:
        p.start()
    partial = root / "step-00000004.partial"
    deadline = time.monotonic() + 120
    try:
        # Wait until both ranks' data files of the step-4 save are on disk.
        while len([f for f in partial.glob("*.distcp") if f.stat().st_size]) < 2:
            assert time.monotonic() < deadline, "the step-4 save never started writing"
            assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert not (partial / "manifest.json").exists()
    assert not (root / "step-00000004").exists()

    assert checkpoint.latest(root) == root / "step-00000002"
    loaded = spawn(_load_worker, 2, tmp_path, 2, str(tmp_path / "store2"), str(root))
    for rank, r in enumerate(loaded):
        assert r["path"] == "step-00000002"
        assert r["digest"] == torch.load(f"{record}{rank}.pt")


# -- what counts as complete (no processes) ----------------------------------------


def test_latest_skips_partial_and_incomplete_folders_naming_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert checkpoint.latest(tmp_path / "none") is None
    good = fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, manifest=False)
    truncated = fake_checkpoint(tmp_path, 6)
    (truncated / "__0_0.distcp").write_bytes(b"d" * 50)
    (tmp_path / "step-00000008.partial").mkdir()
    with caplog.at_level(logging.WARNING, logger="isthmus.checkpoint"):
        assert checkpoint.latest(tmp_path) == good
    text = caplog.text
    assert "step-00000004: no manifest.json" in text
    assert "step-00000006: __0_0.distcp has 50 bytes, the manifest says 100" in text
    assert "step-00000008.partial: not a committed checkpoint" in text


def test_a_manifest_of_another_step_is_not_complete(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 3)
    (path / "manifest.json").write_text(json.dumps({"format": 2, "next_step": 5, "files": {}}))
    assert "says step 5" in checkpoint.check_complete(path)
    assert checkpoint.complete_steps(tmp_path, warn=False) == {}


def test_a_manifest_without_file_hashes_is_refused_by_name(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 3)
    files = {".metadata": 10, "__0_0.distcp": 100}  # format 1: sizes only
    (path / "manifest.json").write_text(json.dumps({"format": 1, "next_step": 3, "files": files}))
    assert "format 1" in checkpoint.check_complete(path)
    assert checkpoint.verify(path) == checkpoint.check_complete(path)


# -- a full disk (issue 33, row 12) -------------------------------------------------


def _full_disk_worker(rank: int, world: int, store: str, root: str) -> dict[str, Any]:
    from tmpfs import fill

    init_gloo(rank, world, store)
    root = Path(root)
    trainer, data = _trainer(ParallelLayout(dp=2))
    trainer.step(0, *data.batch(0))
    checkpoint.save(trainer, root, 1, _residual(rank))
    out: dict[str, Any] = {}
    if rank == 0:
        (root / "step-00000007.partial").mkdir()  # left by a save that died
        (root / "step-00000007.partial" / "__0_0.distcp").write_bytes(b"x" * 4096)
        filler = fill(root.parent)
    dist.barrier()
    trainer.step(1, *data.batch(1))
    try:
        checkpoint.save(trainer, root, 2, _residual(rank))
    except checkpoint.CheckpointError as exc:
        out["error"] = str(exc)
    dist.barrier()
    out["after failure"] = sorted(p.name for p in root.iterdir())
    if rank == 0:
        filler.unlink()
    dist.barrier()
    out["saved"] = checkpoint.save(trainer, root, 2, _residual(rank)).name
    out["after retry"] = sorted(p.name for p in root.iterdir())
    shutdown()
    return out


@pytest.mark.timeout(120)
def test_a_full_disk_names_the_file_and_the_errno_and_leaves_no_partial(tmp_path: Path) -> None:
    """Issue 33, row 12: a save on a full disk (a real one, a small tmpfs) stopped the
    job with an empty reason and left its .partial folder behind."""
    from tmpfs import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        root = disk / "ckpt"
        store = str(tmp_path / "store")  # not on the full disk
        results = spawn(_full_disk_worker, 2, tmp_path, 2, store, str(root))
    for r in results:
        error = r["error"]
        assert error.startswith("no space left on device (ENOSPC) writing "), error
        # The file being written, or the folder when DCP had not opened it yet.
        assert f"{root}/step-00000002.partial" in error, error
        assert "checkpoint step 2 not saved (its .partial folder removed)" in error, error
        # The leftover of an earlier death went before the save began; the failed save's
        # partial folder went after it.
        assert r["after failure"] == ["step-00000001"], r["after failure"]
        assert r["saved"] == "step-00000002"
        assert r["after retry"] == ["step-00000001", "step-00000002"]


@pytest.mark.parametrize("full", ["before", "while writing"])
def test_a_short_write_inside_torch_save_names_its_errno_and_its_file(
    tmp_path: Path, full: str
) -> None:
    """CI, stop 43: torch.save's zip writer reported a disk that filled while it wrote as
    RuntimeError "unexpected pos 704 vs 598", and the free-space probe that named it
    ENOSPC found space again (the other site had just removed its own failed save). The
    stream DCP writes through now raises the OSError that failed the write, named,
    whatever the disk holds by the time the failure is read."""
    from tmpfs import fill, small_tmpfs

    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        filler = fill(disk) if full == "before" else None
        target = disk / "__0_0.distcp"
        naming = FileNamingFileSystem()
        with pytest.raises(OSError) as caught, naming.create_stream(target, "wb") as stream:
            torch.save(torch.zeros(1 << 20), stream)  # 4 MB
        if filler is not None:
            filler.unlink()  # space is back before anyone reads the failure
        else:
            target.unlink()
    error = caught.value
    assert error.errno == errno.ENOSPC
    assert error.filename == str(target)
    if full == "while writing":  # what torch raised is kept as the cause
        assert "unexpected pos" in str(error.__cause__), repr(error.__cause__)
    assert describe_os_error(error) == (f"no space left on device (ENOSPC) writing {target}")


def test_a_runtime_error_without_an_os_error_under_it_passes_unchanged(tmp_path: Path) -> None:
    naming = FileNamingFileSystem()
    with (
        pytest.raises(RuntimeError, match="not a disk"),
        naming.create_stream(tmp_path / "x", "wb"),
    ):
        raise RuntimeError("not a disk")
