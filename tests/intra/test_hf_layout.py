"""Hugging Face configs and weights into isthmus's model (intra/hf_layout.py), checked
by logits against ``transformers`` itself on tiny random models built from a local
config (nothing is downloaded)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers  # the dev extra installs it; never a runtime dependency

from isthmus.intra import hf_layout
from isthmus.intra.model import build_model

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}
# One of each family: Llama with Llama 3's rope scaling (all three of its frequency
# bands present: the unscaled wavelengths are 6.3, 20, 63, ... tokens and the bands
# split at 32/4 = 8 and 32/1 = 32), Qwen2 with its q/k/v biases and a tied head, Mistral
# with a sliding window that no sequence here exceeds.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
}
# fp32 on both sides, the same operations in the same order: measured bitwise equal
# (2026-11-29, torch 2.13 CPU, transformers 5.24). The bound leaves room for another
# attention kernel or rotary arithmetic (isthmus's angles are an outer product,
# transformers' a matmul), a few ulps of logits of magnitude ~2, and fails on any real
# difference: a q/k permutation, a missing bias or a wrong rope band moves them by > 0.1.
LOGITS_TOL = {"atol": 1e-5, "rtol": 0.0}


def hf_model(family: str, folder: Path, seed: int = 0):
    """A tiny random ``transformers`` model of ``family``, saved to ``folder``."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # HF's init leaves biases and norms at 0 and 1: perturb all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_weights_give_transformers_logits(tmp_path: Path, family: str) -> None:
    theirs = hf_model(family, tmp_path)
    cfg = hf_layout.model_config(hf_layout.read_config(tmp_path / "config.json"))
    assert (cfg.kv_heads, cfg.qkv_bias, cfg.tie_embeddings) == (
        2,
        family == "qwen2",
        family == "qwen2",
    )
    assert (cfg.rope_scaling is not None) == (family == "llama")
    ours = build_model(cfg, seed=1)
    hf_layout.load_weights(ours, tmp_path)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, **LOGITS_TOL)


def test_names_round_trip() -> None:
    cfg = hf_layout.model_config({"model_type": "qwen2", **TINY})
    for name, _ in build_model(cfg, 0).named_parameters():
        assert hf_layout.from_hf_name(hf_layout.to_hf_name(name)) == name
    assert (
        hf_layout.to_hf_name("layers.1.attention.wk.bias") == "model.layers.1.self_attn.k_proj.bias"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; isthmus builds llama"),
        ({"hidden_size": None}, "config.json (llama) lacks hidden_size; it needs hidden_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "n_kv_heads=3 must divide n_heads=4"),
    ],
)
def test_unsupported_config_is_one_line(change: dict, message: str) -> None:
    hf = {"model_type": "llama", **TINY, **change}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(hf_layout.HFLayoutError, match=None) as info:
        hf_layout.model_config(hf)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_weights_that_do_not_fit_leave_the_model_unchanged(tmp_path: Path) -> None:
    hf_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    cfg = hf_layout.model_config({**config, "intermediate_size": 128})
    model = build_model(cfg, seed=1)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(hf_layout.HFLayoutError, match="gate_proj.weight has shape"):
        hf_layout.load_weights(model, tmp_path)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_a_preset_shape_exports_as_a_config_transformers_reads(
    tmp_path: Path, qkv_bias: bool
) -> None:
    # What `isthmus export` writes for a job without a config.json of its own: Llama's
    # (Qwen2's with q/k/v biases), here with every option the model has.
    cfg = hf_layout.model_config({"model_type": "llama", **TINY, "rope_scaling": LLAMA3_ROPE})
    cfg = replace(cfg, qkv_bias=qkv_bias, tie_embeddings=qkv_bias)
    ours = build_model(cfg, seed=3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)  # built at 0: make them count
    (tmp_path / "config.json").write_text(json.dumps(hf_layout.hf_config(cfg)))
    hf_layout.save_weights(ours.named_parameters(), tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert type(theirs).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, **LOGITS_TOL)


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests too deep"),  # issue 63: RecursionError
        (b"[1, 2]", "not a JSON object"),
        (b'{"model.embed_tokens.weight": {"dtype": "F32"}}', "has no shape"),
        (b'{"x": 7}', "has no shape"),
    ],
)
def test_a_malformed_safetensors_header_is_named_with_its_file(
    tmp_path: Path, header: bytes, why: str
) -> None:
    hf_model("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(len(header).to_bytes(8, "little") + header)
    cfg = hf_layout.model_config(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(hf_layout.HFLayoutError) as info:
        hf_layout.check_weights(tmp_path, cfg)
    assert str(weights) in str(info.value) and why in str(info.value), info.value
    assert "\n" not in str(info.value)


def test_a_config_json_nested_too_deep_is_named_with_its_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(hf_layout.HFLayoutError, match="nests too deep") as info:
        hf_layout.read_config(path)
    assert str(path) in str(info.value)
