"""Hugging Face's layout of the Llama, Qwen2 and Mistral families, and isthmus's.

Pure functions between the two: a config.json to a ``ModelConfig`` and back, and
parameter names each way (``_BLOCK``, ``_ENDS``). The weights need no reshaping: the
rotary layouts are the same (docs/models.md). Only the safetensors functions at the
end import torch, so the job config can read a config.json before torch is imported.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model_config import Llama3RopeScaling, ModelConfig
from .user_files import decode_problem

if TYPE_CHECKING:
    import torch

    from .model import Transformer

__all__ = [
    "FAMILIES",
    "HFLayoutError",
    "check_weights",
    "from_hf_name",
    "hf_config",
    "load_weights",
    "model_config",
    "read_config",
    "require_safetensors",
    "save_weights",
    "to_hf_name",
]

FAMILIES = ("llama", "qwen2", "mistral")
NEEDED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFLayoutError(ValueError):
    """A config.json or a weights folder isthmus cannot build or load; one line."""


def _refuse_family(model_type: object) -> HFLayoutError:
    return HFLayoutError(
        f"config.json: model_type {model_type!r} is not supported; isthmus builds "
        f"{', '.join(FAMILIES)} from the fields {', '.join(NEEDED)} (and num_key_value_heads, "
        "rms_norm_eps, rope_theta, rope_scaling, tie_word_embeddings)"
    )


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """The rotary base and scaling, from transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` and ``rope_scaling``."""
    params = hf.get("rope_parameters")
    scaling = params if isinstance(params, Mapping) else hf.get("rope_scaling")
    theta = float((params or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    if scaling is None:
        return theta, None
    if not isinstance(scaling, Mapping):
        raise HFLayoutError(f"config.json: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFLayoutError("config.json: partial_rotary_factor != 1 is not supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFLayoutError(
            f"config.json: rope_type {kind!r} is not supported; isthmus implements "
            "'default' and 'llama3'"
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in scaling]
    if missing:
        raise HFLayoutError(f"config.json: llama3 rope scaling lacks {', '.join(missing)}")
    factor, low, high = (float(scaling[f]) for f in fields[:3])
    return theta, Llama3RopeScaling(factor, low, high, int(scaling[fields[3]]))


def _window(hf: Mapping[str, Any], family: str) -> int | None:
    # Mistral's sliding_window; Qwen2's only with use_sliding_window.
    window = hf.get("sliding_window")
    if family == "qwen2" and not hf.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face config.json of the Llama, Qwen2 or Mistral
    family. A sliding attention window (Mistral) sets ``max_seq_len`` to the window:
    attention over sequences no longer than it is full causal attention. HFLayoutError
    names another family, a missing field or a feature isthmus does not implement."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _refuse_family(family)
    missing = [f for f in NEEDED if f not in hf]
    if missing:
        raise HFLayoutError(
            f"config.json ({family}) lacks {', '.join(missing)}; it needs {', '.join(NEEDED)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise HFLayoutError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    for flag in ("attention_bias", "mlp_bias"):  # Llama's: o_proj / MLP biases as well
        if hf.get(flag):
            raise HFLayoutError(f"config.json: {flag} = true is not supported")
    if hf.get("attention_dropout", 0.0):
        raise HFLayoutError("config.json: attention_dropout > 0 is not supported")
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads * int(head_dim) != dim:
        raise HFLayoutError(
            f"config.json: head_dim={head_dim} x num_attention_heads={heads} must equal "
            f"hidden_size={dim}"
        )
    theta, scaling = _rope(hf)
    max_len = int(hf["max_position_embeddings"])
    window = _window(hf, family)
    try:
        return ModelConfig(
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            ffn_hidden=int(hf["intermediate_size"]),
            max_seq_len=min(max_len, window) if window else max_len,
            vocab_size=int(hf["vocab_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=family == "qwen2",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except (TypeError, ValueError) as exc:
        raise HFLayoutError(f"config.json ({family}): {exc}") from None


def read_config(path: Path | str) -> dict[str, Any]:
    """A config.json, parsed; HFLayoutError if it is missing or not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise HFLayoutError(f"{path} not found") from None
    except (OSError, ValueError) as exc:
        raise HFLayoutError(f"{path} is not readable JSON: {exc}") from None
    except RecursionError:  # json's parser recurses once a level (issue 63)
        raise HFLayoutError(f"{path} is not a config: its JSON nests too deep") from None
    if not isinstance(data, dict):
        raise HFLayoutError(f"{path} is not a JSON object")
    return data


def hf_config(cfg: ModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of a model of shape ``cfg``, for ``transformers``: ``base`` (the
    one it was built from) as it is, or else a Llama config (Qwen2 with q/k/v biases,
    which Llama's ``attention_bias`` would put on o_proj as well). HFLayoutError for a
    mixture of experts, which has no layout in these families."""
    if cfg.n_experts:
        raise HFLayoutError(
            f"a mixture of experts (n_experts={cfg.n_experts}) has no Hugging Face Llama, "
            "Qwen2 or Mistral layout; export a dense model"
        )
    if base is not None:
        if model_config(base) != cfg:
            raise HFLayoutError("the model's shape differs from its config.json's")
        return dict(base)
    family, arch = ("qwen2", "Qwen2ForCausalLM") if cfg.qkv_bias else ("llama", "LlamaForCausalLM")
    scaling = cfg.rope_scaling  # its fields are Hugging Face's names
    return {
        "architectures": [arch],
        "model_type": family,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        # The older spelling (top-level rope_theta, rope_scaling): transformers 5 reads it too.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if scaling is None else {"rope_type": "llama3"} | asdict(scaling),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_ENDS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS = re.compile(r"^layers\.(\d+)\.(.+?)((?:\.weight|\.bias)?)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+?)((?:\.weight|\.bias)?)$")


def _translate(name: str, pattern: re.Pattern, table: Mapping[str, str], prefix: str) -> str:
    match = pattern.match(name)
    if match is not None:
        layer, rest, suffix = match.groups()
        for source, target in table.items():
            if rest + suffix == source:
                return f"{prefix}{layer}.{target}"
            if rest == source and suffix:
                return f"{prefix}{layer}.{target}{suffix}"
    raise HFLayoutError(f"parameter {name!r} has no counterpart in the other layout")


def to_hf_name(name: str) -> str:
    """isthmus's parameter name -> Hugging Face's."""
    if name in _ENDS:
        return _ENDS[name]
    return _translate(name, _OURS, _BLOCK, "model.layers.")


def from_hf_name(name: str) -> str:
    """Hugging Face's parameter name -> isthmus's."""
    ends = {v: k for k, v in _ENDS.items()}
    if name in ends:
        return ends[name]
    return _translate(name, _THEIRS, {v: k for k, v in _BLOCK.items()}, "layers.")


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a model of shape ``cfg`` holds."""
    d, f, kv = cfg.dim, cfg.ffn_hidden, cfg.kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if cfg.qkv_bias:
            biases = {"q": d, "k": kv, "v": kv}
            out |= {f"{p}self_attn.{x}_proj.bias": (n,) for x, n in biases.items()}
    out["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def _weight_files(folder: Path) -> list[Path]:
    """``model.safetensors``, or the shards its index names."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / INDEX).is_file():
        index = read_config(folder / INDEX).get("weight_map")
        if not isinstance(index, dict):
            raise HFLayoutError(f"{folder / INDEX} has no weight_map")
        return [folder / name for name in sorted(set(index.values()))]
    raise HFLayoutError(f"{folder} holds neither {WEIGHTS} nor {INDEX}")


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's table of tensors (an 8-byte length, then JSON), read
    without the library or torch."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise HFLayoutError(f"{path}: a {size}-byte header is not a safetensors file")
            table = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise HFLayoutError(f"{path} is not a readable safetensors file: {exc}") from None
    except RecursionError:  # json's parser recurses once a level (issue 63)
        raise HFLayoutError(
            f"{path} is not a safetensors file: its header nests too deep"
        ) from None
    if not isinstance(table, dict):
        raise HFLayoutError(f"{path} is not a safetensors file: its header is not a JSON object")
    table.pop("__metadata__", None)
    for name, entry in table.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise HFLayoutError(f"{path}: tensor {name[:80]!r} has no shape (a list of ints)")
    return table


def check_weights(folder: Path | str, cfg: ModelConfig) -> None:
    """HFLayoutError, naming the first tensor missing, extra or misshapen, unless
    ``folder``'s safetensors hold exactly the tensors of a model of shape ``cfg`` (a tied
    model's ``lm_head.weight`` may be there too). Reads only the files' headers."""
    folder = Path(folder)
    found: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(folder):
        if not path.is_file():
            raise HFLayoutError(f"{path} is missing (named by {INDEX})")
        found |= {name: tuple(entry["shape"]) for name, entry in _header(path).items()}
    if cfg.tie_embeddings:
        found.pop("lm_head.weight", None)
    expected = _expected(cfg)
    for name, shape in expected.items():
        if name not in found:
            raise HFLayoutError(f"{folder}: the weights lack {name}")
        if found[name] != shape:
            raise HFLayoutError(
                f"{folder}: {name} has shape {list(found[name])}, the model needs {list(shape)}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise HFLayoutError(f"{folder}: the weights hold {extra[0]}, which the model lacks")


def require_safetensors() -> None:
    if importlib.util.find_spec("safetensors") is None:
        raise HFLayoutError(
            "reading and writing model.safetensors needs the safetensors package: "
            "pip install 'isthmus[hf]'"
        )


def load_weights(model: Transformer, folder: Path | str) -> None:
    """Copy a Hugging Face model folder's weights into ``model``, a whole unsharded
    ``Transformer``. HFLayoutError when the folder does not fit it (``check_weights``:
    ``model`` is then unchanged) or a file's data does not read (naming the file)."""
    import torch

    require_safetensors()
    from safetensors import safe_open

    folder = Path(folder)
    check_weights(folder, model.cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path in _weight_files(folder):
            # One tensor at a time from the memory-mapped file: a rank never holds a
            # second copy of the model.
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                        ours = from_hf_name(name)
                        if ours in params:  # a tied head's lm_head.weight is the embedding
                            params[ours].copy_(f.get_tensor(name))
            except Exception as exc:  # noqa: BLE001 - SafetensorError is a bare Exception
                # The header was checked; the data may still be cut short or mistyped.
                raise HFLayoutError(
                    f"{path} is not a readable safetensors file: {decode_problem(exc)}"
                ) from None


def save_weights(named: Iterable[tuple[str, torch.Tensor]], folder: Path | str) -> Path:
    """Write isthmus-named full tensors as ``folder/model.safetensors`` in Hugging
    Face's names (a tied model passes no ``output.weight``)."""
    require_safetensors()
    from safetensors.torch import save_file

    tensors = {to_hf_name(name): t.detach().to("cpu").contiguous() for name, t in named}
    path = Path(folder) / WEIGHTS
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
