"""Every file a user hands isthmus that does not decode is named in one line (issue 63).

A safetensors header nesting 100,000 deep once stopped a job with a bare ``maximum
recursion depth exceeded``, naming no file. Each case here writes one broken file and
hands it to the entry point a user reaches it through (the CLI, or the function the
launcher and the ranks call); the error must name the file and say what is wrong, on
one line, as the error type the CLI prints without a traceback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, fake_checkpoint, run_cli

from isthmus.deploy.commands.arguments import read_rank_secret
from isthmus.deploy.config.job import ConfigError, load_config
from isthmus.deploy.security.trust import site_security
from isthmus.intra import hf_layout
from isthmus.intra.corpus.tokenizer import TextTokenizer, file_facts
from isthmus.intra.corpus.tokens import (
    PREPARED_FORMAT,
    PREPARED_VERSION,
    from_path,
    prepared_corpus,
)
from isthmus.intra.model import build_model
from isthmus.intra.model_config import preset

pytestmark = pytest.mark.timeout(120)

DEEP = b"[" * 100_000  # json and tomllib recurse once a level
NOT_UTF8 = b"\xff\xfe\x00garbage"
PREPARED = {"format": PREPARED_FORMAT, "version": PREPARED_VERSION}


def _prepared(tmp: Path, manifest: bytes | dict, shards: dict[str, bytes] | None = None) -> Path:
    folder = tmp / "prepared"
    folder.mkdir()
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(raw)
    for name, data in (shards or {}).items():
        (folder / name).write_bytes(data)
    return folder


def _config(tmp: Path, data: bytes) -> tuple[Path, Callable[[], object]]:
    path = tmp / "job.toml"
    path.write_bytes(data)
    return path, lambda: load_config(path)


def _manifest(tmp: Path, data: bytes | dict) -> tuple[Path, Callable[[], object]]:
    folder = _prepared(tmp, data)
    return folder / "manifest.json", lambda: prepared_corpus(folder)


def _empty_shard(tmp: Path) -> tuple[Path, Callable[[], object]]:
    manifest = {**PREPARED, "dtype": "uint16", "shards": [{"file": "s0.bin", "tokens": 0}]}
    folder = _prepared(tmp, manifest, {"s0.bin": b""})
    return folder / "s0.bin", lambda: prepared_corpus(folder)


def _corpus(tmp: Path, name: str, data: bytes) -> tuple[Path, Callable[[], object]]:
    path = tmp / name
    path.write_bytes(data)
    return path, lambda: from_path(path, dtype="uint16")


def _tokenizer(tmp: Path, data: bytes, read: Callable) -> tuple[Path, Callable[[], object]]:
    path = tmp / "tokenizer.json"
    path.write_bytes(data)
    return path, lambda: read(path)


def _weights(tmp: Path) -> tuple[Path, Callable[[], object]]:
    """model.init_from's folder whose safetensors header is sound but whose data is
    cut short (the header check passes; the read of the tensors does not)."""
    cfg = preset("tiny")
    model = build_model(cfg, seed=0)
    (tmp / "config.json").write_text(json.dumps(hf_layout.hf_config(cfg)))
    weights = hf_layout.save_weights(model.named_parameters(), tmp)
    weights.write_bytes(weights.read_bytes()[:-4096])
    return weights, lambda: hf_layout.load_weights(build_model(cfg, seed=1), tmp)


def _rank_secret(tmp: Path, mode: int) -> tuple[Path, Callable[[], object]]:
    path = tmp / "rank.secret"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(mode)
    return path, lambda: read_rank_secret(str(path))


def _token(tmp: Path, data: bytes) -> tuple[Path, Callable[[], object]]:
    path = tmp / "job.token"
    path.write_bytes(data)
    config = load_config(None, ["security.require_token=true", f"security.token_file={path}"])
    return path, lambda: site_security(config.security, "site0")


CASES: dict[str, Callable[[Path], tuple[Path, Callable[[], object]]]] = {
    "config nested too deep": lambda t: _config(t, b"a = " + DEEP),
    "config not UTF-8": lambda t: _config(t, NOT_UTF8),
    "config a folder": lambda t: (t, lambda: load_config(t)),
    "prepared manifest nested too deep": lambda t: _manifest(t, DEEP),
    "prepared manifest without its shards": lambda t: _manifest(t, PREPARED),
    "prepared manifest with shards of another kind": lambda t: _manifest(
        t, {**PREPARED, "dtype": "uint16", "shards": [{"file": 3, "tokens": "x"}]}
    ),
    "prepared shard empty": _empty_shard,
    "corpus .npy that is not one": lambda t: _corpus(t, "tokens.npy", b"garbage" * 8),
    "corpus .bin empty": lambda t: _corpus(t, "tokens.bin", b""),
    "corpus .bin cut mid-token": lambda t: _corpus(t, "tokens.bin", b"abc"),
    "tokenizer nested too deep (job)": lambda t: _tokenizer(t, DEEP, file_facts),
    "tokenizer nested too deep (data prepare)": lambda t: _tokenizer(
        t, DEEP, TextTokenizer.from_file
    ),
    "tokenizer not UTF-8 (data prepare)": lambda t: _tokenizer(
        t, NOT_UTF8, TextTokenizer.from_file
    ),
    "init_from weights cut short": _weights,
    "rank secret readable by others": lambda t: _rank_secret(t, 0o644),
    "job token not printable": lambda t: _token(t, b"\x00\x01 token with spaces"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_file_that_does_not_decode_is_named_in_one_line(tmp_path: Path, case: str) -> None:
    if "init_from" in case or "tokenizer" in case and "job" not in case:
        pytest.importorskip("safetensors" if "init_from" in case else "tokenizers")
    path, read = CASES[case](tmp_path)
    with pytest.raises((ValueError, ConfigError)) as refused:
        read()
    message = str(refused.value)
    assert str(path) in message and "\n" not in message, message
    assert "maximum recursion depth" not in message, message


def test_a_checkpoint_whose_manifest_nests_too_deep_is_named_by_the_cli(tmp_path: Path) -> None:
    """``isthmus export`` of a checkpoint folder (what ``--resume`` checks the same way)."""
    step = fake_checkpoint(tmp_path / "checkpoints", 4)
    (step / "manifest.json").write_bytes(DEEP)
    config = tmp_path / "config.toml"
    config.write_text("")
    result = run_cli(
        "export", str(step), "--to", "hf", str(tmp_path / "out"), "--config", str(config),
        timeout=120,
    )  # fmt: skip
    assert_one_line_error(result, str(step), "manifest.json: it nests too deep")


def test_a_config_that_nests_too_deep_is_named_by_the_cli(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_bytes(b"[train]\nsteps = " + DEEP)
    result = run_cli("local", "--config", str(config), timeout=120)
    assert_one_line_error(result, str(config), "it nests too deep")


def test_decoding_a_sound_file_is_unchanged(tmp_path: Path) -> None:
    """The wrapping changes only failures: a corpus of tokens reads as it did."""
    path = tmp_path / "tokens.bin"
    path.write_bytes(torch.arange(64, dtype=torch.int16).numpy().tobytes())
    assert from_path(path, dtype="uint16").tokens.shape[0] == 64
