"""`isthmus export RUN_OR_CHECKPOINT --to hf DIR`: a checkpoint's weights in the Hugging
Face layout (config.json and model.safetensors), for ``transformers`` and everything
else that reads it; ``model.init_from = DIR`` trains on from it (docs/models.md).
`--to safetensors DIR`: the parameters under their own names (DIR/model.safetensors),
the way out of a script's run (``isthmus.deploy.api.load_parameters`` reads it back).

A run folder exports its newest checkpoint complete at any site (replicas are
identical: the step `isthmus local --resume` would take); a checkpoint folder
(``.../checkpoints/site0/step-00000040``) exports that one, with the job config found
beside it (the run's config.toml) or given with --config. The checkpoint is verified by
content (and signature, where the job signs) before anything reads it, its sharded
parameters are gathered into whole tensors in this one process, and DIR is written
only once all of that succeeded (into a temporary folder, then renamed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from isthmus.deploy.commands import add_command
from isthmus.deploy.commands.arguments import add_set_argument
from isthmus.deploy.config.job import ConfigError, JobConfig, load_config
from isthmus.deploy.security.trust import checkpoint_key

__all__ = ["export_hf", "export_safetensors", "register"]

FORMATS = ("hf", "safetensors")


def _find_config(path: Path, given: str | None, overrides: list[str]) -> tuple[JobConfig, Path]:
    """The job config of a run or checkpoint folder, and the run folder."""
    if given is not None:
        return load_config(given, overrides), path
    # A checkpoint sits in RUN/checkpoints/SITE/step-N: look up to three levels above.
    for folder in (path, *path.parents[:3]):
        found = sorted(folder.glob("config*.toml"))
        if found:
            return load_config(found[0], overrides), folder
    raise ConfigError(f"no config.toml in or above {path}: give the job's with --config")


def _checkpoint(path: Path, config: JobConfig, run_dir: Path) -> Path:
    """``path`` if it is a committed checkpoint, else the newest complete one of any
    site of the run in ``run_dir``."""
    from isthmus.deploy.rank.checkpointing import site_root
    from isthmus.intra import checkpoint

    if path.name.startswith("step-"):
        problem = checkpoint.check_complete(path)
        if problem is not None:
            raise ConfigError(f"{path} is not a complete checkpoint: {problem}")
        return path
    newest: dict[int, Path] = {}
    for site in config.site_names:
        newest |= checkpoint.complete_steps(site_root(config, run_dir, site), warn=False)
    if not newest:
        raise ConfigError(
            f"{path} holds no complete checkpoint (a run with --run-dir saves one after its "
            "last step; checkpoint.every > 0 saves them on the way)"
        )
    return newest[max(newest)]


def export_hf(source: Path, out: Path, config: JobConfig, run_dir: Path) -> tuple[Path, int]:
    """Write ``out/config.json`` and ``out/model.safetensors`` from the checkpoint of
    ``source`` (see the module doc); returns the checkpoint and its parameter count.
    ConfigError, with nothing written, when the checkpoint is missing, fails verification
    or holds another model, the model has no Hugging Face layout, or ``out`` has files."""
    import torch

    from isthmus.intra import hf_layout
    from isthmus.intra.model import Transformer

    _require_empty(out)
    if config.run.script_sha256:
        raise ConfigError(
            f"{source} is the run of a script: its parameters carry the script's own "
            "names, not isthmus's model's; `--to safetensors DIR` writes them as they are, "
            "and isthmus.deploy.api.load_parameters(DIR, model) loads them into the "
            "script's module (a transformers model then has save_pretrained)"
        )
    cfg = config.resolved_model()
    model = config.model
    base_path = model.hf_config or (
        str(Path(model.init_from) / "config.json") if model.init_from else ""
    )
    try:
        hf_layout.require_safetensors()
        base = hf_layout.read_config(base_path) if base_path else None
        hf = hf_layout.hf_config(cfg, base)
    except ValueError as exc:
        raise ConfigError(f"export: {exc}") from None
    path, params = _parameters(source, config, run_dir)
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}
    found = {n: tuple(t.shape) for n, t in params.items()}
    if found != expected:
        differ = sorted(set(found) ^ set(expected)) or [
            n for n in expected if found[n] != expected[n]
        ]
        raise ConfigError(
            f"checkpoint {path} does not hold this job's model (first difference: "
            f"{differ[0]}); give the job's config with --config"
        )
    with _staged(out) as staging:
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        hf_layout.save_weights(params.items(), staging)
    return path, sum(t.numel() for t in params.values())


def export_safetensors(
    source: Path, out: Path, config: JobConfig, run_dir: Path
) -> tuple[Path, int]:
    """Write ``out/model.safetensors``: the checkpoint's full parameters under their own
    names (a script's module's, or isthmus's model's); as :func:`export_hf` otherwise."""
    from isthmus.intra import hf_layout

    _require_empty(out)
    try:
        hf_layout.require_safetensors()
    except ValueError as exc:
        raise ConfigError(f"export: {exc}") from None
    from safetensors.torch import save_file

    path, params = _parameters(source, config, run_dir)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in params.items()}
    with _staged(out) as staging:
        save_file(tensors, str(staging / hf_layout.WEIGHTS), metadata={"format": "pt"})
    return path, sum(t.numel() for t in params.values())


def _parameters(source: Path, config: JobConfig, run_dir: Path):
    """The checkpoint of ``source`` (see ``_checkpoint``) and its full parameters by
    name, verified first; a failed verification is one ConfigError line."""
    from isthmus.intra import checkpoint

    path = _checkpoint(source, config, run_dir)
    try:
        return path, checkpoint.full_parameters(
            path, checkpoint_key(config.security, config.checkpoint)
        )
    except checkpoint.CheckpointError as exc:
        raise ConfigError(str(exc)) from None


def _require_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty folder")


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out``, renamed to it once the block wrote it all:
    ``out`` never holds half an export."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty (checked before)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def cmd_export(args: argparse.Namespace) -> int:
    """write a checkpoint in the Hugging Face layout (config.json, model.safetensors)

    Write a run's newest checkpoint (or the checkpoint folder given) as a Hugging Face model
    folder: config.json and model.safetensors, loadable by transformers'
    AutoModelForCausalLM.from_pretrained and by model.init_from. Needs the isthmus[hf] extra
    (safetensors)."""
    args.format, args.to_dir = args.to
    if args.format not in FORMATS:
        raise ConfigError(f"--to {args.format}: the formats are {', '.join(FORMATS)}")
    source = Path(args.source)
    if not source.exists():
        raise ConfigError(f"{source} not found: give a run's --run-dir or a checkpoint folder")
    config, run_dir = _find_config(source, args.config, args.overrides)
    if args.format == "hf":
        path, count = export_hf(source, Path(args.to_dir), config, run_dir)
        wrote = "config.json and model.safetensors"
    else:
        path, count = export_safetensors(source, Path(args.to_dir), config, run_dir)
        wrote = "model.safetensors"
    print(f"wrote {args.to_dir}/{wrote}: {count:,} parameters of {path}")
    return 0


def register(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = add_command(sub, formatter, "export", cmd_export)
    add = parser.add_argument
    add("source", metavar="RUN_OR_CHECKPOINT", help="a run's --run-dir or a step-NNNNNNNN folder")
    add(
        "--to",
        nargs=2,
        metavar=("FORMAT", "DIR"),
        required=True,
        help="the layout (hf, or "
        "safetensors: the parameters under their own names, a script's run's way out) and the "
        "folder to write (new, or empty)",
    )
    add(
        "--config",
        metavar="TOML",
        help="the job's config (default: the config.toml in or above RUN_OR_CHECKPOINT)",
    )
    add_set_argument(parser, help="override a key of the job's config (repeatable)")
