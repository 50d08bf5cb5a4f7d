"""The model of a job whose shape is a Hugging Face config.json (``model.hf_config``,
or ``model.init_from``'s), resolved and checked before any process starts
(docs/models.md); ``JobConfig.resolved_model`` calls it."""

from __future__ import annotations

from pathlib import Path

from isthmus.deploy.config.sections import ModelSection
from isthmus.deploy.config.validation import ConfigError
from isthmus.intra import hf_layout
from isthmus.intra.model_config import ModelConfig

__all__ = ["hf_model_config"]


def hf_model_config(model: ModelSection, *, seq_len: int, vocab: int) -> ModelConfig:
    """The config.json's shape as it is, checked against the job.

    Args:
        model: the job's [model] section; ``hf_config`` or ``init_from`` is set.
        seq_len: train.seq_len, which may not exceed the config's positions.
        vocab: the tokenizer's ids, which the config's vocabulary must hold.

    Raises:
        ConfigError: one line naming the key: a config.json isthmus cannot build (its
            family, a field, a feature), size overrides beside it, weights that do not
            fit it (init_from, read from the files' headers), or a tokenizer or
            sequence length it cannot take.
    """
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
