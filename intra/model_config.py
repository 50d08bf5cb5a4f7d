"""The decoder's shape (``ModelConfig``) and the named presets, without torch: the job
config and the CLI resolve and check a model before any process imports torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["PRESETS", "ModelConfig", "preset"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the decoder."""

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Attention heads; ``dim`` must be a multiple, and the head size even (rotary)."""
    ffn_hidden: int
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int
    """Longest sequence the rotary tables cover."""
    vocab_size: int = 256
    """Token ids; 256 for raw bytes."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    init_std: float = 0.02
    """Standard deviation of the weight init (output projections are scaled down by depth)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"ModelConfig head size dim/n_heads={self.dim // self.n_heads} must be even (rotary)"
            )
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_params(self) -> int:
        """Parameters of the whole decoder (``Transformer.num_params()``), unbuilt."""
        d, f, v = self.dim, self.ffn_hidden, self.vocab_size
        block = 4 * d * d + 3 * d * f + 2 * d  # attention, SwiGLU MLP, two norms
        return 2 * v * d + self.n_layers * block + d  # embedding, head, final norm


PRESETS: dict[str, ModelConfig] = {
    # CPU unit tests: ~0.13M parameters.
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, ffn_hidden=172, max_seq_len=128),
    # `isthmus local` on a 2-core CPU: ~1.9M parameters.
    "small": ModelConfig(dim=192, n_layers=4, n_heads=6, ffn_hidden=512, max_seq_len=256),
    # GPU sizes (SwiGLU, three MLP matrices): ~114M, ~360M and ~1.03B parameters.
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, ffn_hidden=3072, max_seq_len=1024),
    "350m": ModelConfig(dim=1024, n_layers=28, n_heads=16, ffn_hidden=2816, max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=20, n_heads=16, ffn_hidden=5632, max_seq_len=2048),
}


def preset(name: str) -> ModelConfig:
    """Return a copy of a preset (``PRESETS`` entries are shared; callers may edit the copy).

    Raises:
        ValueError: on an unknown name.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name])
