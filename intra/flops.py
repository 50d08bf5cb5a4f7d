"""Throughput accounting: device peak FLOP/s, model FLOPs utilization, and the LR rule.

MFU = achieved model FLOP/s ÷ peak FLOP/s of the devices, where achieved model
FLOP/s = tokens/s × ``Transformer.flops_per_token`` (6N + 12 L d T: forward and
backward, *without* activation-checkpointing recompute, as in PaLM). Recompute
makes a run slower without raising its MFU.
"""

from __future__ import annotations

import math

import torch

# Dense (no 2:4 sparsity) peak FLOP/s by device-name substring, checked in order.
# bf16 tensor-core figures from the vendors' data sheets; SXM parts (PCIe
# variants are lower: H100 PCIe 756 TFLOP/s, so MFU on them is understated).
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    # Not a measured number: a placeholder so CPU runs print an MFU at all.
    # A modern server core does roughly 50-100 GFLOP/s fp32 with AVX-512 FMA.
    "cpu": 100e9,
}


def device_peak_flops(device: torch.device | str | None = None) -> float:
    """Peak dense bf16 FLOP/s of one CUDA device, by its name (an unknown GPU: the H100
    figure, so MFU is only indicative); the CPU placeholder for ``None`` or a CPU."""
    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return PEAK_FLOPS["cpu"]
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return peak
    return PEAK_FLOPS["H100"]


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, num_devices: int) -> float:
    """Model FLOPs utilization: achieved FLOP/s ÷ (num_devices × peak_flops), where
    ``tokens_per_s`` are the tokens the devices process together (tp and pp ranks share
    tokens, so do not count them once per rank)."""
    if peak_flops <= 0 or num_devices < 1:
        raise ValueError(
            f"need peak_flops > 0 and num_devices >= 1, got {peak_flops}, {num_devices}"
        )
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)


LR_RULES = ("sqrt", "linear", "none")


def scaled_lr(base_lr: float, dp_total: int, rule: str = "sqrt", reference_dp: int = 1) -> float:
    """Learning rate for a run whose data-parallel width is ``dp_total`` = sites × dp,
    ``base_lr`` tuned at ``reference_dp``: ``linear`` (Goyal et al. 2017, for SGD),
    ``sqrt`` (for Adam: Malladi et al. 2022) or ``none``. Pass the configured width, not
    the live one, so every site applies the same update."""
    if rule not in LR_RULES:
        raise ValueError(f"lr scaling rule must be one of {list(LR_RULES)}, got {rule!r}")
    if dp_total < 1 or reference_dp < 1:
        raise ValueError(f"dp_total and reference_dp must be >= 1, got {dp_total}, {reference_dp}")
    ratio = dp_total / reference_dp
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr
