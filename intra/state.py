"""A rank's full training state as named tensors (``model/``, ``optim/``, ``rng/``,
``meta/next_step``, ``extra/``; docs/checkpoints.md): what a rejoining site copies from a
live peer and what a checkpoint holds for one rank. The names are the same at every site
for the rank at one mesh coordinate. The data position needs no entry: batches are drawn
from ``(seed, step)`` alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .digest import local_shard
from .train import Trainer

OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")
EXTRA = "extra/"
NEXT_STEP = "meta/next_step"


class StateError(ValueError):
    """A state does not fit this rank's trainer; the message names the first problem."""


def named_parameters(trainer: Trainer) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters by fully qualified name, over all its model parts
    (pipeline stages keep the whole model's names, so they are unique)."""
    out = [(fqn, p) for part in trainer.model_parts for fqn, p in part.named_parameters()]
    assert len({fqn for fqn, _ in out}) == len(out), "parameter names repeat across model parts"
    return out


def _step_dtype() -> torch.dtype:
    # What AdamW gives its (non-capturable) "step" tensors: torch.optim's scalar dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def expected_layout(trainer: Trainer) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every non-extra entry of this rank's state."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for fqn, p in named_parameters(trainer):
        local = local_shard(p)
        for name in (f"model/{fqn}", f"optim/{fqn}/exp_avg", f"optim/{fqn}/exp_avg_sq"):
            out[name] = (tuple(local.shape), local.dtype)
        out[f"optim/{fqn}/step"] = ((), _step_dtype())
    out["rng/cpu"] = (tuple(torch.get_rng_state().shape), torch.uint8)
    if trainer.device.type == "cuda":
        out["rng/cuda"] = (tuple(torch.cuda.get_rng_state(trainer.device).shape), torch.uint8)
    out[NEXT_STEP] = ((), torch.int64)
    return out


def ensure_optimizer_state(trainer: Trainer) -> None:
    """Create AdamW's per-parameter state where it does not exist yet (a fresh
    trainer): zeros and step 0, exactly what AdamW's lazy initialisation makes."""
    for _, p in named_parameters(trainer):
        state = trainer.optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


@torch.no_grad()
def rank_state(
    trainer: Trainer, next_step: int, extra: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's training state, ``next_step`` the step it resumes at and ``extra``
    stored as ``extra/<name>``: CPU copies that share nothing with the trainer, so they
    may be served (or written) while training goes on. Call between steps."""
    if next_step < 0:
        raise ValueError(f"next_step must be >= 0, got {next_step}")
    out: dict[str, torch.Tensor] = {}
    for fqn, p in named_parameters(trainer):
        out[f"model/{fqn}"] = _copy(local_shard(p))
        state = trainer.optimizer.state.get(p)
        for key in OPTIM_KEYS:
            if state:
                value = _copy(local_shard(state[key]))
            elif key == "step":  # not stepped yet: what AdamW would start from
                value = torch.tensor(0.0, dtype=_step_dtype())
            else:
                value = torch.zeros_like(_copy(local_shard(p)))
            out[f"optim/{fqn}/{key}"] = value
    out[NEXT_STEP] = torch.tensor(next_step, dtype=torch.int64)
    return out | rank_entries(trainer, extra)


def rank_entries(trainer: Trainer, extra: Mapping[str, torch.Tensor] | None) -> dict:
    """The entries of a rank's state that are its own: RNG states, and ``extra`` copied."""
    out = {"rng/cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        out["rng/cuda"] = torch.cuda.get_rng_state(trainer.device)
    return out | {EXTRA + name: _copy(t) for name, t in (extra or {}).items()}


def check_state(trainer: Trainer, state: Mapping[str, torch.Tensor]) -> None:
    """Raise StateError naming the first entry that does not fit ``trainer``: missing
    names first (in the trainer's order), unexpected ones (sorted), then each entry's
    type, dtype and shape."""
    layout = expected_layout(trainer)
    for name in layout:
        if name not in state:
            raise StateError(f"state lacks {name!r} ({len(state)} entries given)")
    for name in sorted(state):
        if name not in layout and not name.startswith(EXTRA):
            raise StateError(f"unexpected state entry {name!r}")
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            raise StateError(f"state entry {name!r} is a {type(value).__name__}, not a tensor")
        if name not in layout:
            continue
        shape, dtype = layout[name]
        if value.dtype != dtype:
            raise StateError(f"state entry {name!r} has dtype {value.dtype}, expected {dtype}")
        if tuple(value.shape) != shape:
            raise StateError(
                f"state entry {name!r} has shape {tuple(value.shape)}, expected {shape}"
            )
    if int(state[NEXT_STEP]) < 0:
        raise StateError(f"{NEXT_STEP} must be >= 0, got {int(state[NEXT_STEP])}")


@torch.no_grad()
def load_rank_state(
    trainer: Trainer, state: Mapping[str, torch.Tensor]
) -> tuple[int, dict[str, torch.Tensor]]:
    """Copy a state from ``rank_state`` (of the same mesh coordinate) into ``trainer``;
    returns ``(next_step, extra)``, the ``extra/`` entries without their prefix. All is
    checked before anything is written, so on a StateError it is unchanged."""
    check_state(trainer, state)
    ensure_optimizer_state(trainer)
    for fqn, p in named_parameters(trainer):
        local_shard(p).copy_(state[f"model/{fqn}"])
        opt = trainer.optimizer.state[p]
        for key in OPTIM_KEYS:
            local_shard(opt[key]).copy_(state[f"optim/{fqn}/{key}"])
    torch.set_rng_state(state["rng/cpu"].cpu())
    if trainer.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng/cuda"].cpu(), trainer.device)
    extra = {name[len(EXTRA) :]: t for name, t in state.items() if name.startswith(EXTRA)}
    return int(state[NEXT_STEP]), extra


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
