"""One site: topology, model, data, TP/PP/FSDP2 parallelism, the training step."""

from importlib import import_module
from typing import TYPE_CHECKING

# Where each public name lives. Importing the package imports none of them (PEP 562):
# `isthmus.intra.layout` and `.model_config` are plain data the CLI reads without
# torch, and the rest would cost a few seconds of torch imports per process.
_HOMES = {
    "Corpus": "corpus.tokens",
    "ShardedBatches": "corpus.batches",
    "from_path": "corpus.tokens",
    "stdlib_corpus": "corpus.tokens",
    "parameter_digest": "digest",
    "PEAK_FLOPS": "flops",
    "device_peak_flops": "flops",
    "mfu": "flops",
    "scaled_lr": "flops",
    "MeshAxis": "layout",
    "ParallelConfig": "layout",
    "ParallelLayout": "layout",
    "PipelineSchedule": "layout",
    "Transformer": "model",
    "build_model": "model",
    "PRESETS": "model_config",
    "ModelConfig": "model_config",
    "preset": "model_config",
    "apply_fsdp": "parallel",
    "parallelize": "parallel",
    "build_site_mesh": "topology",
    "mesh_coordinate": "topology",
    "GradientSync": "train",
    "StepStats": "train",
    "TrainConfig": "train",
    "Trainer": "train",
}

if TYPE_CHECKING:
    from .corpus.batches import ShardedBatches
    from .corpus.tokens import Corpus, from_path, stdlib_corpus
    from .digest import parameter_digest
    from .flops import PEAK_FLOPS, device_peak_flops, mfu, scaled_lr
    from .layout import MeshAxis, ParallelConfig, ParallelLayout, PipelineSchedule
    from .model import Transformer, build_model
    from .model_config import PRESETS, ModelConfig, preset
    from .parallel import apply_fsdp, parallelize
    from .topology import build_site_mesh, mesh_coordinate
    from .train import GradientSync, StepStats, TrainConfig, Trainer


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{home}", __name__), name)


__all__ = [
    "PEAK_FLOPS",
    "PRESETS",
    "Corpus",
    "GradientSync",
    "MeshAxis",
    "ModelConfig",
    "ParallelConfig",
    "ParallelLayout",
    "PipelineSchedule",
    "ShardedBatches",
    "StepStats",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "apply_fsdp",
    "build_model",
    "build_site_mesh",
    "device_peak_flops",
    "from_path",
    "mesh_coordinate",
    "mfu",
    "parallelize",
    "parameter_digest",
    "preset",
    "scaled_lr",
    "stdlib_corpus",
]
