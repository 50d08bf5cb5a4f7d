"""What the planning model (sim/plan.py) needs of a job: its model preset as a
PlanInput and its codec's ratio of raw to wire bytes. `isthmus plan --preset` and the
quick start's choice of sync mode (deploy/launch/quickstart.py) read the same numbers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.sim.plan import PlanInput

# Raw bytes per wire byte of each tensor codec on fp32 gradients (inter/data/codecs/): int8
# carries one fp32 scale per 1024 values (0.4 %: left out). A zstd stage
# depends on the data: pass --codec-ratio measured by a run (summary.json).
TENSOR_CODEC_RATIO = {"raw": 1.0, "bf16": 2.0, "int8": 4.0, "int4": 8.0}


def preset_input(
    name: str, *, seq_len: int, bandwidth_bps: float, rtt_s: float, **fields
) -> PlanInput:
    """A PlanInput for one of isthmus' model presets, trained as `isthmus local` does;
    ``fields``: any other PlanInput field. ConfigError: an unknown preset."""
    import torch

    from isthmus.intra.model import Transformer

    config = load_config(
        overrides=[
            f"model.preset={name}",
            f"train.seq_len={seq_len}",
            f"wan.bandwidth_mbit={bandwidth_bps / 1e6}",
            f"wan.latency_ms={rtt_s / 2 * 1000}",
        ]
    )
    cfg = config.resolved_model()
    with torch.device("meta"):
        model = Transformer(cfg)
    rounds = cfg.n_layers + 1  # one FSDP group per block, plus the root's own
    values: dict[str, Any] = {  # PlanInput's fields, floats and ints
        "params": float(model.num_params()),
        "active_params": float(model.num_params(active=True)),
        "flops_per_token": model.flops_per_token(seq_len),
        "rounds": rounds,
        "overlap": (rounds - 1) / rounds,
        "chunk_bytes": float(config.chunk_bytes),
        "window": config.sync.rounds_in_flight,
        "gradient_bytes_per_param": 4.0,  # fp32 shards cross sites (reduce_dtype fp32)
        "bandwidth_bps": bandwidth_bps,
        "rtt_s": rtt_s,
        "devices_per_site": 1,
        "mfu": 0.4,
    }
    values.update({k: v for k, v in fields.items() if v is not None})
    if "tokens_per_step" in values:
        return PlanInput(**values)
    # The batch `isthmus local` trains: train.batch_size sequences a device.
    inputs = PlanInput(**values, tokens_per_step=float(seq_len))
    sequences = config.train.batch_size * inputs.devices_per_site * inputs.sites
    return replace(inputs, tokens_per_step=float(sequences * seq_len))


def codec_ratio(spec: str) -> float:
    """Nominal raw / wire bytes of a sync.codec chain on fp32 gradients (zstd counted 1);
    ConfigError when it is not a valid sync.codec."""
    from isthmus.inter.data import make_codec

    try:
        make_codec(spec)
    except ValueError as exc:
        raise ConfigError(f"--codec: {exc}") from None
    tensor = spec.split("+")[0].split(":")[0]
    return TENSOR_CODEC_RATIO.get(tensor, 1.0)
