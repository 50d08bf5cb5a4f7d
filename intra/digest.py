"""A digest of the full parameters, equal for equal weights whatever the sharding."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def parameter_digest(model: nn.Module) -> str:
    """sha256 over the full parameters, in ``named_parameters()`` order.

    Each parameter contributes its name and shape, then its values as fp32,
    contiguous, CPU bytes. Sharded (DTensor) parameters are gathered with
    ``full_tensor()``, so this is a collective: every rank of the site must call it.

    Args:
        model: a plain or FSDP2-sharded module.

    Returns:
        The hex digest.
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()
