"""One site: topology, model, data, TP/PP/FSDP2 parallelism, the training step."""

from .data import Corpus, ShardedBatches, from_path, stdlib_corpus
from .digest import parameter_digest
from .flops import PEAK_FLOPS, device_peak_flops, mfu, scaled_lr
from .model import PRESETS, ModelConfig, Transformer, build_model, preset
from .parallel import ParallelConfig, PipelineSchedule, apply_fsdp, parallelize
from .topology import MeshAxis, ParallelLayout, build_site_mesh, mesh_coordinate
from .train import GradientSync, StepStats, TrainConfig, Trainer

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
