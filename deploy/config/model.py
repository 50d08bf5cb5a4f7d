"""The model a job trains, resolved and checked before any process starts: a preset
with the [model] section's overrides, or the shape of a Hugging Face config.json
(``model.hf_config``, or ``model.init_from``'s; docs/models.md)."""

from __future__ import annotations

from pathlib import Path

from isthmus.deploy.config.sections import ConfigError, DataSection, ModelSection
from isthmus.intra import hf_layout
from isthmus.intra.corpus.tokenizer import BYTE_VOCAB, file_vocab_size
from isthmus.intra.model_config import ModelConfig, preset

__all__ = ["hf_model_config", "resolved_model"]


def resolved_model(model: ModelSection, data: DataSection, *, seq_len: int) -> ModelConfig:
    """The preset with the section's overrides, or the config.json's shape; max_seq_len
    covers train.seq_len and vocab_size the tokenizer's ids (256 bytes, data.vocab_size for
    a bpe or token ids, a file's ids padded to a multiple of 64). Raises ConfigError: an
    unknown preset, a shape the model refuses, an unreadable tokenizer file."""
    try:
        if data.tokenizer == "bytes":
            vocab = data.vocab_size if data.pretokenized else BYTE_VOCAB
        else:
            vocab = data.vocab_size if data.tokenizer == "bpe" else file_vocab_size(data.tokenizer)
    except ValueError as exc:
        raise ConfigError(f"data.tokenizer: {exc}") from None
    if model.hf_config or model.init_from:
        return hf_model_config(model, seq_len=seq_len, vocab=vocab)
    try:
        cfg = preset(model.preset)
        cfg.vocab_size = vocab
        if model.dim:
            cfg.dim = model.dim
            # Keep the SwiGLU hidden size at ~8/3 dim, rounded up to a multiple of 8.
            cfg.ffn_hidden = -(-int(8 * cfg.dim / 3) // 8) * 8
        if model.n_layers:
            cfg.n_layers = model.n_layers
        if model.n_heads:
            cfg.n_heads = model.n_heads
        if model.capacity_factor and not cfg.n_experts:
            raise ValueError(
                f"capacity_factor={model.capacity_factor} needs a mixture of "
                f"experts (a moe-* preset), got {model.preset!r}"
            )
        cfg.capacity_factor = model.capacity_factor
        cfg.max_seq_len = max(cfg.max_seq_len, seq_len)
        cfg.__post_init__()  # re-validate after the overrides
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    return cfg


def hf_model_config(model: ModelSection, *, seq_len: int, vocab: int) -> ModelConfig:
    """The config.json's shape as it is (``model.hf_config`` or ``init_from`` is set),
    checked against the job: ``seq_len`` may not exceed its positions, its vocabulary
    must hold the tokenizer's ``vocab`` ids. Raises ConfigError, one line naming the key:
    a config.json isthmus cannot build (its family, a field, a feature), size overrides
    beside it, or weights that do not fit it (init_from, read from the files' headers)."""
    for key in ("dim", "n_layers", "n_heads"):
        if getattr(model, key):
            raise ConfigError(f"model.{key} does not apply with a config.json (model.hf_config)")
    path = model.hf_config or str(Path(model.init_from) / "config.json")
    key = "model.hf_config" if model.hf_config else "model.init_from"
    try:
        cfg = hf_layout.model_config(hf_layout.read_config(path))
    except ValueError as exc:  # "config.json: ..." or "PATH not found"
        text = str(exc).removeprefix("config.json: ").replace(f"{path} ", "")
        raise ConfigError(f"{key}: {path}: {text}") from None
    if model.init_from:
        try:
            hf_layout.require_safetensors()  # the ranks read them
            hf_layout.check_weights(model.init_from, cfg)
        except ValueError as exc:
            raise ConfigError(f"model.init_from: {exc}") from None
    if vocab > cfg.vocab_size:
        raise ConfigError(
            f"model: {path} has vocab_size={cfg.vocab_size}, fewer than the tokenizer's "
            f"{vocab} ids (data.tokenizer)"
        )
    if seq_len > cfg.max_seq_len:
        raise ConfigError(
            f"train.seq_len={seq_len} exceeds the {cfg.max_seq_len} positions of {path} "
            "(max_position_embeddings, or its sliding_window)"
        )
    return cfg
