"""The TOML side of a job config: reading the file, a command-line value as TOML reads
it, coercing a value to its key's type, and writing one back (job.py applies them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from isthmus.deploy.config.sections import ConfigError
from isthmus.intra.user_files import DECODE_ERRORS, decode_problem

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib

PER_SITE = ("topology.ranks_per_site", "train.accumulate")
"""Keys that take one integer for every site or a list of one per site."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """The config file's tables; ConfigError names what is wrong with it."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except DECODE_ERRORS as exc:  # not UTF-8, not TOML, nested too deep, a folder
        raise ConfigError(f"config file {path} is not valid TOML: {decode_problem(exc)}") from None


def toml_string(value: str | bool) -> str:
    return json.dumps(value, ensure_ascii=False)  # a TOML basic string, or true/false


def _toml_value(text: str) -> Any:
    """A command-line value as TOML reads it, else the string (refused by the caller)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def _coerce_per_site(where: str, raw: Any) -> int | list[int]:
    """An integer, or a list of them (TOML `[4, 2]`, or `4,2` from the command line)."""
    if isinstance(raw, str):
        text = raw.strip()
        raw = _toml_value(f"[{text}]" if "," in text and not text.startswith("[") else text)
    if isinstance(raw, list) and raw and all(type(n) is int for n in raw):
        return list(raw)
    if type(raw) is int:
        return raw
    raise ConfigError(f"{where} must be an integer or a list of them (one per site), got {raw!r}")


def coerce(section: str, key: str, raw: Any, expected: Any) -> Any:
    """``raw`` as the type of ``expected`` (the key's value now); ConfigError otherwise."""
    where = f"{section}.{key}"
    if where in PER_SITE:
        return _coerce_per_site(where, raw)
    kind = type(expected)
    if isinstance(raw, str) and kind is not str:
        raw = _toml_value(raw.strip())
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif kind is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif kind is str:
        return str(raw)
    raise ConfigError(f"{where} must be {kind.__name__}, got {raw!r}")
