"""The script's model as the rank's machinery reads one (deploy/api.py's ``attach``):
its model and optimizer shaped as the built-in ``Trainer`` is, the optimizer checked
before anything else reads it, the script's own state beside the rank's, and
``load_parameters``, the way back from ``isthmus export --to safetensors``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from isthmus.intra.digest import parameter_digest
from isthmus.intra.train import TrainConfig

__all__ = [
    "clip_gradients",
    "site_mean",
    "USER_PREFIX",
    "ScriptModel",
    "UserState",
    "check_optimizer",
    "load_parameters",
    "script_device",
]

USER_PREFIX = "user/"
"""The script's own state in a checkpoint (and in a state transfer), beside the rank's."""


class ScriptModel:
    """The script's model and optimizer, shaped as the built-in ``Trainer`` is where the
    rank's machinery reads one (state and checkpoints, state transfer, outer optimizer,
    digests): one model part, its FSDP groups, the site's mesh."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, steps: int
    ) -> None:
        self.model, self.model_parts, self.optimizer, self.mesh = model, [model], optimizer, mesh
        self.device = script_device(mesh.device_type)
        self.pp, self.dp, self.cp, self.tp = 1, mesh.size(), 1, 1
        self.coordinate = (0, mesh.get_local_rank(), 0, 0)
        self.groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.sync = None  # the outer optimizer checks that the model does not sync itself
        self.step_in_progress = 0
        self.backward_twice = False  # a group's hook ran twice in one step (no ``ctx.no_sync()``)
        self.tied = None  # one model part: no head tied across pipeline stages (intra/tied.py)
        # Only the outer learning rate's ramp reads it (OuterOptimizer.lr_at).
        self.config = TrainConfig(total_steps=steps, warmup_steps=0)
        check_optimizer(model, optimizer)
        self.stepping = False  # while ``Context.step`` steps the optimizer; others are refused
        optimizer.register_step_pre_hook(self._refuse_own_steps)

    def _refuse_own_steps(self, *_: object) -> None:
        if not self.stepping:
            raise RuntimeError(
                "the script called optimizer.step() itself: ctx.step() steps the optimizer "
                "once the sites' gradients are averaged; remove the script's own call"
            )

    def step_optimizer(self) -> None:
        self.stepping = True
        try:
            self.optimizer.step()
        finally:
            self.stepping = False

    def parameter_digest(self) -> str:
        return parameter_digest(self.model_parts)


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuses, in one line, an optimizer whose state checkpoints and state transfers
    cannot hold (they carry Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``), or whose
    parameters are not the model's: found at attach, not at the first checkpoint
    (``KeyError: 'exp_avg'``) or as "replicas differ" at the end (issue 60)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"ctx.attach: isthmus checkpoints and moves Adam and AdamW state (exp_avg, "
            f"exp_avg_sq, step); got {type(optimizer).__name__}: use torch.optim.AdamW "
            "or torch.optim.Adam"
        )
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise ValueError(
            "ctx.attach: amsgrad=True keeps max_exp_avg_sq, which isthmus's checkpoints "
            "do not hold; use amsgrad=False"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trained = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    missing = [name for key, name in trained.items() if key not in held]
    if missing:
        raise ValueError(
            f"ctx.attach: the optimizer does not hold the model's parameter {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + ": make it with model.parameters() after the model is built (and sharded)"
        )
    foreign = held - {id(p) for p in model.parameters()}
    if foreign:
        raise ValueError(
            f"ctx.attach: the optimizer holds {len(foreign)} tensor(s) that are not "
            "parameters of the attached model: make it with model.parameters() of this model"
        )


class UserState:
    """The script's own tensors, carried in checkpoints and state transfers as the
    rank's extra entries (where the built-in trainer's batch plan goes)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def state(self) -> dict[str, torch.Tensor]:
        return {USER_PREFIX + k: v for k, v in self.tensors.items()}

    def load_state(self, extra: Mapping[str, torch.Tensor]) -> None:
        for key, value in extra.items():
            if key.startswith(USER_PREFIX) and key[len(USER_PREFIX) :] in self.tensors:
                with torch.no_grad():
                    self.tensors[key[len(USER_PREFIX) :]].copy_(value)


def script_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


@torch.no_grad()
def load_parameters(source: str | Path, model: nn.Module) -> None:
    """Loads what ``isthmus export RUN --to safetensors DIR`` wrote (``DIR`` or its
    ``model.safetensors``) into ``model``, a plain module (load before ``fully_shard``):
    a script's trained model, back in the script's own module, outside any job.
    ValueError, the module left as it was, on no such file or parameters whose names or
    shapes differ from the module's (the first one named)."""
    from safetensors.torch import load_file

    path = Path(source)
    path = path / "model.safetensors" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"load_parameters: {path} not found (isthmus export --to safetensors)")
    saved = load_file(str(path))
    found = {name: tuple(t.shape) for name, t in saved.items()}
    wanted = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if found != wanted:
        differ = [n for n in wanted if found.get(n) != wanted[n]]
        name = (differ or [n for n in found if n not in wanted])[0]
        raise ValueError(
            f"load_parameters: {path} does not hold this module's parameters (first "
            f"difference: {name!r}, {found.get(name, 'absent')} saved, "
            f"{wanted.get(name, 'absent')} in the module)"
        )
    for name, p in model.named_parameters():
        p.copy_(saved[name])


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Clips the gradients' global norm (over the site's shards: FSDP2's are DTensors)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def site_mean(model: nn.Module) -> None:
    """Averages a plain (unsharded) model's gradients over the site's ranks."""
    world = dist.get_world_size()
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
