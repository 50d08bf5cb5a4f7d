"""Atomic per-site checkpoints with torch.distributed.checkpoint (DCP).

Every rank of the site calls ``save``. The checkpoint holds the state of
``state.py``: parameters and AdamW state as DTensors (DCP writes each shard once,
indexed by its place in the global tensor), and each rank's own entries (RNG,
``extra``) under ``rank<R>/`` so DCP never merges them across ranks.

Commit protocol, so a crash at any point leaves the previous checkpoint usable:

1. every rank writes into ``ROOT/step-00000012.partial/`` (DCP, files fsynced);
2. barrier; rank 0 writes ``manifest.json`` (step, world size, layout, every
   file's size and SHA-256; signed with HMAC-SHA256 under the job token when the job
   has one), fsyncs it, renames the folder to ``ROOT/step-00000012/`` and fsyncs
   ``ROOT``: the rename is the commit;
3. only then are checkpoints beyond the newest ``keep`` deleted (but never the step
   named by ``protect``: the newest one complete at every site, deploy/rank/checkpointing.py).

A save that fails (a full disk: issue 33, row 12) removes its ``.partial`` folder and
raises a CheckpointError naming the errno and the file; every save first removes what
saves that died left (``.partial``, ``.stale-*``), so a restart frees it before it writes.

``latest`` counts a folder only if its manifest lists every file at its recorded size.
``load`` checks every file's hash (and the signature, given the key) before torch reads
a byte: DCP's ``.metadata`` is a pickle, and a flipped byte in a weight file would load
as a silently wrong weight (issue 14: loss NaN at every site from the next step).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint_errors import CheckpointError, describe_os_error
from .checkpoint_failures import FileNamingFileSystem, dcp_failure
from .digest import local_shard
from .state import (
    NEXT_STEP,
    OPTIM_KEYS,
    ensure_optimizer_state,
    load_rank_state,
    named_parameters,
    rank_entries,
)
from .tied import checkpoint_name
from .train import Trainer
from .user_files import DECODE_ERRORS, decode_problem

log = logging.getLogger("isthmus.checkpoint")

FORMAT = 2
"""2: every file's SHA-256 in the manifest (1 had sizes only, and is refused)."""
MANIFEST = "manifest.json"
PARTIAL = ".partial"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_READ_BYTES = 8 << 20


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _layout(trainer: Trainer) -> dict[str, int]:
    return {"pp": trainer.pp, "dp": trainer.dp, "tp": trainer.tp}


def _rank_prefix(rank: int) -> str:
    return f"rank{rank}/"


def _saved_names(trainer: Trainer) -> dict[str, str]:
    """This rank's parameter names -> their names in a checkpoint: the same, but for
    the head's copy of a weight tied across pipeline stages, which is saved (once, DCP
    drops the equal duplicate) and loaded as the embedding (intra/tied.py)."""
    return {fqn: checkpoint_name(trainer.tied, fqn, p) for fqn, p in named_parameters(trainer)}


def _sharded_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state as DTensors (shared, not copied), by checkpoint name."""
    ensure_optimizer_state(trainer)
    saved = _saved_names(trainer)
    out: dict[str, torch.Tensor] = {}
    for fqn, p in named_parameters(trainer):
        out[f"model/{saved[fqn]}"] = p.detach()
        state = trainer.optimizer.state[p]
        for key in OPTIM_KEYS:
            out[f"optim/{saved[fqn]}/{key}"] = state[key]
    return out


def _rank_names(trainer: Trainer, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``entries`` under this rank's parameter names (``_saved_names`` undone)."""
    renamed = {saved: fqn for fqn, saved in _saved_names(trainer).items() if saved != fqn}
    out = {}
    for name, t in entries.items():
        kind, _, rest = name.partition("/")
        for saved, fqn in renamed.items():
            if kind in ("model", "optim") and (rest == saved or rest.startswith(saved + "/")):
                name = f"{kind}/{fqn}{rest[len(saved) :]}"
        out[name] = t
    return out


def save(
    trainer: Trainer,
    root: Path,
    next_step: int,
    extra: Mapping[str, torch.Tensor] | None = None,
    *,
    keep: int | None = 2,
    protect: int | None = None,
    key: bytes | None = None,
) -> Path:
    """Write and commit the site's checkpoint after ``next_step`` steps into the site's
    shared ``root``; returns the committed folder. A collective of the site's default
    process group, between steps; a checkpoint of the same step is replaced.

    ``extra``: this rank's own tensors (codec residuals), which ``load`` returns.
    ``keep``: committed checkpoints kept, newest by step (None: all); ``protect``: a step
    never pruned; ``key``: signs the manifest (HMAC-SHA256, the job token).
    """
    root = Path(root)
    final = step_dir(root, next_step)
    partial = final.with_name(final.name + PARTIAL)
    rank = dist.get_rank()
    problem: list[str | None] = [None]
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)  # of saves that died: free their space first
            partial.mkdir()
        except OSError as exc:
            problem[0] = describe_os_error(exc, partial)
    _raise_if_failed(problem, partial, next_step)  # also the barrier before DCP
    state: dict[str, torch.Tensor] = _sharded_state(trainer)
    state[NEXT_STEP] = torch.tensor(next_step, dtype=torch.int64)
    prefix = _rank_prefix(rank)
    state.update({prefix + k: v for k, v in rank_entries(trainer, extra).items()})
    started = time.perf_counter()
    try:
        writer = dcp.FileSystemWriter(partial, sync_files=True)
        writer.fs = FileNamingFileSystem()
        dcp.save(state, storage_writer=writer)
    except CheckpointException as exc:  # raised at every rank alike: DCP gathers failures
        problem[0] = dcp_failure(exc, partial) if rank == 0 else "failed"  # rank 0's says
    if problem[0] is None and rank == 0:
        try:
            _commit(trainer, partial, final, next_step, key)
            _prune(root, keep, protect)
        except OSError as exc:
            problem[0] = describe_os_error(exc, partial)
    _raise_if_failed(problem, partial, next_step)
    took = time.perf_counter() - started
    log.info("[rank %d step %d] checkpoint %s written in %.2fs", rank, next_step, final, took)
    return final


def _raise_if_failed(problem: list[str | None], partial: Path, next_step: int) -> None:
    """Share rank 0's verdict with the site (a collective); on a failure rank 0 removes
    the partial folder (a full disk gets its space back), and every rank raises."""
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    raise CheckpointError(
        f"{problem[0]}: checkpoint step {next_step} not saved (its {PARTIAL} folder removed)"
    )


def _remove_leftovers(root: Path) -> None:
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith("step-") and not _STEP_DIR.match(path.name):
            shutil.rmtree(path, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_READ_BYTES):
            h.update(block)
    return h.hexdigest()


def _signature(manifest: Mapping, key: bytes) -> str:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def _commit(
    trainer: Trainer, partial: Path, final: Path, next_step: int, key: bytes | None
) -> None:
    files = {
        p.relative_to(partial).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(partial.rglob("*"))
        if p.is_file()
    }
    manifest: dict = {
        "format": FORMAT,
        "next_step": next_step,
        "world_size": dist.get_world_size(),
        "layout": _layout(trainer),
        "files": files,
    }
    if key:
        manifest["signature"] = _signature(manifest, key)
    tmp = partial / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(partial / MANIFEST)
    _fsync_dir(partial)
    stale = None
    if final.exists():  # the same step again (a resumed run): swap, then delete
        stale = final.with_name(f"{final.name}.stale-{os.getpid()}")
        final.rename(stale)
    partial.rename(final)
    _fsync_dir(final.parent)
    if stale is not None:
        shutil.rmtree(stale)


def _prune(root: Path, keep: int | None, protect: int | None = None) -> None:
    committed = sorted(complete_steps(root, warn=False).items())
    doomed = [path for step, path in committed[:-keep] if step != protect] if keep else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    _remove_leftovers(root)


def check_complete(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` if it is."""
    match = _STEP_DIR.match(path.name)
    if match is None:
        return "not a committed checkpoint folder (name is not step-NNNNNNNN)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except DECODE_ERRORS as exc:
        return f"unreadable {MANIFEST}: {decode_problem(exc)}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return (
            f"{MANIFEST} is format {found!r}, not {FORMAT} (format 1, of older isthmus "
            "releases, records no file hashes, so nothing it lists can be verified)"
        )
    if manifest.get("next_step") != int(match.group(1)):
        return f"{MANIFEST} says step {manifest.get('next_step')!r}, the folder {match.group(1)}"
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return f"{MANIFEST} lists no DCP .metadata"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)):
            return f"{MANIFEST} has no size for {name}"
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}"
    return None


def verify(path: Path, key: bytes | None = None) -> str | None:
    """Why ``path`` is not a complete checkpoint whose every file has the content its
    manifest records (and, given ``key``, a manifest signed with it); ``None`` if it is.

    Reads every file once; nothing is unpickled or handed to torch.
    """
    path = Path(path)
    problem = check_complete(path)
    if problem is not None:
        return problem
    manifest = json.loads((path / MANIFEST).read_text())
    if key:
        signature = manifest.get("signature")
        if not isinstance(signature, str):
            return f"{MANIFEST} is not signed, and this job has a token to check it with"
        if not hmac.compare_digest(signature, _signature(manifest, key)):
            return f"{MANIFEST}'s signature does not match the job token"
    for name, entry in manifest["files"].items():
        if _sha256(path / name) != entry.get("sha256"):
            return f"{name} does not match its SHA-256 in {MANIFEST} (changed since the save)"
    return None


def complete_steps(root: Path, *, warn: bool = True) -> dict[int, Path]:
    """Step -> folder of every complete checkpoint under ``root`` (which may not exist);
    ``warn`` logs each incomplete or partial folder skipped."""
    root = Path(root)
    out: dict[int, Path] = {}
    if not root.is_dir():
        return out
    for path in sorted(root.iterdir()):
        if not path.is_dir() or not path.name.startswith("step-"):
            continue
        problem = check_complete(path)
        if problem is None:
            out[int(path.name[len("step-") :])] = path
        elif warn:
            log.warning("skipping checkpoint %s: %s", path, problem)
    return out


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``; incomplete ones are skipped, named."""
    steps = complete_steps(root)
    return steps[max(steps)] if steps else None


def load(
    trainer: Trainer, path: Path, key: bytes | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """Load a checkpoint written by ``save`` with the same site layout (a collective);
    returns ``(next_step, extra)``. Nothing of the trainer changes until every entry has
    been read and checked; ``key``: the manifest must be signed with it (None: unchecked).

    Raises:
        CheckpointError: incomplete, changed since the save (naming the file), unsigned
            or signed with another key, or saved by another world size or layout.
    """
    path = Path(path)
    # Rank 0 reads every file once; the site's ranks share its verdict.
    verdict = [verify(path, key) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    _usable(path, verdict[0])
    manifest = json.loads((path / MANIFEST).read_text())
    mine = {"world_size": dist.get_world_size(), "layout": _layout(trainer)}
    theirs = {k: manifest[k] for k in mine}
    if theirs != mine:
        raise CheckpointError(f"checkpoint {path} was saved by {theirs}, this site is {mine}")
    prefix = _rank_prefix(dist.get_rank())
    # Fresh buffers with the trainer's placements: DCP fills this rank's shards.
    targets = {name: torch.empty_like(t) for name, t in _sharded_state(trainer).items()}
    targets[NEXT_STEP] = torch.empty((), dtype=torch.int64)
    _read(path, targets, prefix)
    local = {name.removeprefix(prefix): local_shard(t) for name, t in targets.items()}
    return load_rank_state(trainer, _rank_names(trainer, local))


def full_parameters(path: Path, key: bytes | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint as one whole tensor, by name, read in this one
    process without a process group (``isthmus export``): DCP reassembles each from
    the shards the site's ranks saved, whatever their tp, fsdp and pp layout.

    Raises:
        CheckpointError: incomplete, changed since the save, or unsigned (``verify``).
    """
    path = Path(path)
    _usable(path, verify(path, key))
    targets: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # "assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _read(path, targets, "model/", no_dist=True)
    return {name[len("model/") :]: t for name, t in targets.items()}


def _usable(path: Path, problem: str | None) -> None:
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is not usable: {problem}")


def _read(path: Path, targets: dict[str, torch.Tensor], prefix: str, **kwargs: bool) -> None:
    """DCP's load of ``targets`` and of every tensor entry under ``prefix``, in place."""
    reader = dcp.FileSystemReader(path)
    for entry, meta in reader.read_metadata().state_dict_metadata.items():
        if entry.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            targets[entry] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        dcp.load(targets, storage_reader=reader, **kwargs)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise CheckpointError(f"reading checkpoint {path}: {exc}") from exc
