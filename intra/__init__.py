"""One site: topology, model, data, FSDP2 data parallelism, the training step."""

from .data import Corpus, ShardedBatches, from_path, stdlib_corpus
from .digest import parameter_digest
from .model import PRESETS, ModelConfig, Transformer, build_model, preset
from .parallel import apply_fsdp
from .topology import MeshAxis, ParallelLayout, build_site_mesh
from .train import GradientSync, StepStats, TrainConfig, Trainer

__all__ = [
    "PRESETS",
    "Corpus",
    "GradientSync",
    "MeshAxis",
    "ModelConfig",
    "ParallelLayout",
    "ShardedBatches",
    "StepStats",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "apply_fsdp",
    "build_model",
    "build_site_mesh",
    "from_path",
    "parameter_digest",
    "preset",
    "stdlib_corpus",
]
