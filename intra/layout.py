"""A site's parallelism as validated settings: ``ParallelLayout`` (ranks per axis) and
``ParallelConfig`` (the techniques). Plain data without torch, so that the job config,
the CLI and the planning model check a layout before any process imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model_config import ModelConfig

__all__ = ["MeshAxis", "ParallelConfig", "ParallelLayout", "PipelineSchedule", "StrEnum"]

try:
    from enum import StrEnum
except ImportError:  # Python 3.10 (pyproject allows it); same behavior for our use

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return self.value


class MeshAxis(StrEnum):
    """Names of the device-mesh axes inside one site (outermost first)."""

    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelLayout:
    """How one site's ranks are split across the parallel axes."""

    pp: int = 1
    """Pipeline-parallel stages."""
    dp: int = 1
    """Data-parallel (FSDP2) replicas inside the site."""
    cp: int = 1
    """Context-parallel ranks per replica: each holds 1/cp of every sequence (two
    chunks, one from each end, so causal attention's work is even) and gathers the
    others' keys and values; FSDP2 shards over dp × cp."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""

    def __post_init__(self) -> None:
        for axis in MeshAxis:
            _check_count(f"ParallelLayout.{axis.value}", getattr(self, axis.value))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @classmethod
    def for_ranks(cls, ranks: int, pp: int = 1, tp: int = 1, cp: int = 1) -> ParallelLayout:
        """The layout of a site of ``ranks`` ranks: ``dp = ranks // (pp * cp * tp)``."""
        _check_count("ranks_per_site", ranks)
        probe = cls(pp=pp, tp=tp, cp=cp)  # validates pp, tp and cp
        model_ranks = probe.pp * probe.cp * probe.tp
        if ranks % model_ranks:
            raise ValueError(
                f"ranks_per_site={ranks} is not divisible by pp*cp*tp={model_ranks} "
                f"(pp={probe.pp}, cp={probe.cp}, tp={probe.tp}); choose ranks_per_site as "
                "a multiple of pp*cp*tp"
            )
        return cls(pp=probe.pp, dp=ranks // model_ranks, cp=probe.cp, tp=probe.tp)


class PipelineSchedule(StrEnum):
    """``torch.distributed.pipelining`` schedules."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Techniques a site uses on top of its ``ParallelLayout`` (pp × dp × tp sizes)."""

    schedule: str = PipelineSchedule.ONE_F_ONE_B.value
    """Pipeline schedule when ``pp > 1``: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``."""
    microbatches: int | None = None
    """Micro-batches per step when ``pp > 1``; must divide the per-rank batch.
    ``None``: ``pp * stages_per_rank`` (the fewest that keep every stage busy)."""
    stages_per_rank: int | None = None
    """Pipeline stages (layer chunks) each pp rank holds. ``None``: 2 for
    ``interleaved_1f1b`` (it needs >= 2), else 1 (``gpipe``/``1f1b`` need exactly 1)."""
    sequence_parallel: bool = False
    """With ``tp > 1``: shard norms and the residual stream along the sequence
    (Megatron SP); saves activation memory, turns all-reduces into
    reduce-scatter + all-gather. Needs ``seq_len`` divisible by ``tp``."""
    activation_checkpoint: bool = False
    """Recompute each block's activations in backward (full, per block)."""
    compile: bool = False
    """``torch.compile`` each transformer block (on CPU this needs a C compiler)."""
    mixed_precision: bool = False
    """bf16 compute with fp32 parameters and fp32 gradient reduction (CUDA only)."""
    expert_parallel: int = 1
    """Mixture of experts: split the experts over this many dp ranks (each holds
    ``n_experts / expert_parallel``; tokens reach their experts by all-to-all). Must
    divide dp and n_experts."""
    offload: bool = False
    """FSDP2's CPU offload: the sharded parameters, their gradients and AdamW's state
    live in host memory (pinned on CUDA), each group is copied to the device for its
    all-gather, and the optimizer steps on the CPU. For a model whose sharded state
    does not fit the devices; costs the copies and a CPU optimizer step."""

    def __post_init__(self) -> None:
        allowed = [s.value for s in PipelineSchedule]
        if self.schedule not in allowed:
            raise ValueError(
                f"ParallelConfig.schedule must be one of {allowed}, got {self.schedule!r}"
            )
        _check_count("ParallelConfig.expert_parallel", self.expert_parallel)
        for name in ("microbatches", "stages_per_rank"):
            if getattr(self, name) is not None:
                _check_count(f"ParallelConfig.{name}", getattr(self, name))
        interleaved = self.schedule == PipelineSchedule.INTERLEAVED_1F1B
        if self.stages_per_rank is not None:
            if interleaved and self.stages_per_rank < 2:
                raise ValueError(
                    "ParallelConfig.stages_per_rank must be >= 2 for interleaved_1f1b, "
                    f"got {self.stages_per_rank}"
                )
            if not interleaved and self.stages_per_rank != 1:
                raise ValueError(
                    f"ParallelConfig.stages_per_rank must be 1 for {self.schedule}, "
                    f"got {self.stages_per_rank}"
                )
        for name in ("sequence_parallel", "activation_checkpoint", "compile", "mixed_precision"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ParallelConfig.{name} must be true or false, got {getattr(self, name)!r}"
                )

    @property
    def local_stages(self) -> int:
        """``stages_per_rank`` resolved."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule == PipelineSchedule.INTERLEAVED_1F1B else 1

    def num_microbatches(self, pp: int) -> int:
        """``microbatches`` resolved for ``pp`` ranks."""
        return self.microbatches if self.microbatches is not None else pp * self.local_stages

    def check(
        self, layout: ParallelLayout, model: ModelConfig, *, batch_size: int, seq_len: int
    ) -> None:
        """ValueError naming the field that does not fit a layout, a model shape and the
        per-rank batch (sequences per dp rank)."""
        self._check_model_split(layout, model)
        self._check_sequence_split(layout, seq_len)
        if self.mixed_precision and not _cuda_available():
            raise ValueError("ParallelConfig.mixed_precision needs CUDA (bf16 on CPU is slow)")
        if layout.pp > 1:
            self._check_pipeline(layout, model, batch_size)

    def _check_model_split(self, layout: ParallelLayout, model: ModelConfig) -> None:
        """The model's heads, widths and experts split evenly over tp and ep."""
        tp = layout.tp
        for name in ("n_heads", "ffn_hidden", "vocab_size", "dim"):
            if getattr(model, name) % tp:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(model, name)} must be divisible by "
                    f"ParallelLayout.tp={tp}"
                )
        if model.kv_heads % tp:
            raise ValueError(
                f"ModelConfig.n_kv_heads={model.kv_heads} must be divisible by "
                f"ParallelLayout.tp={tp} (each tp rank holds whole key/value heads)"
            )
        if model.n_experts and self.sequence_parallel and tp > 1:
            raise ValueError(
                f"ParallelConfig.sequence_parallel is not supported with ModelConfig.n_experts="
                f"{model.n_experts}: expert layers run whole on every tp rank"
            )
        ep = self.expert_parallel
        if ep > 1:
            if not model.n_experts or model.n_experts % ep:
                raise ValueError(
                    f"expert parallelism over ep={ep} needs a mixture of experts whose "
                    f"n_experts is a multiple of it, got n_experts={model.n_experts}"
                )
            if layout.dp % ep:
                raise ValueError(
                    f"expert parallelism needs ep={ep} to divide dp={layout.dp} (the experts "
                    "are split over dp ranks)"
                )

    def _check_sequence_split(self, layout: ParallelLayout, seq_len: int) -> None:
        """Each sequence splits evenly over cp, and each cp chunk over tp with sequence
        parallelism."""
        cp, tp = layout.cp, layout.tp
        if cp > 1 and seq_len % (2 * cp):
            raise ValueError(
                f"ParallelLayout.cp={cp} needs seq_len={seq_len} divisible by 2*cp={2 * cp} "
                "(each cp rank holds two equal chunks of every sequence)"
            )
        local_seq = seq_len // cp
        if self.sequence_parallel and tp > 1 and local_seq % tp:
            raise ValueError(
                f"ParallelConfig.sequence_parallel needs seq_len/cp={local_seq} divisible "
                f"by tp={tp}"
            )

    def _check_pipeline(self, layout: ParallelLayout, model: ModelConfig, batch_size: int) -> None:
        """With ``pp > 1``: enough layers for the stages, and micro-batches that divide
        the batch and fit the schedule."""
        stages = layout.pp * self.local_stages
        if model.n_layers < stages:
            raise ValueError(
                f"ModelConfig.n_layers={model.n_layers} is fewer than the pipeline stages "
                f"pp*stages_per_rank={stages}"
            )
        micro = self.num_microbatches(layout.pp)
        if batch_size % micro:
            raise ValueError(
                f"ParallelConfig.microbatches={micro} must divide the per-rank batch_size={batch_size}"
            )
        if self.schedule == PipelineSchedule.ONE_F_ONE_B and micro < layout.pp:
            raise ValueError(
                f"ParallelConfig.microbatches={micro} must be >= pp={layout.pp} for 1f1b"
            )
        if self.schedule == PipelineSchedule.INTERLEAVED_1F1B:
            rounds = max(1, micro // layout.pp)
            if micro % rounds:
                raise ValueError(
                    f"ParallelConfig.microbatches={micro} must be a multiple of "
                    f"max(1, microbatches // pp)={rounds} for interleaved_1f1b"
                )


def _check_count(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an integer >= 1, got {value!r}")


def _cuda_available() -> bool:
    import torch  # only a mixed-precision config asks, and only where it is checked

    return torch.cuda.is_available()
