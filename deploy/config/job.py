"""Typed job configuration: a TOML file plus command-line overrides.

Precedence, lowest first: the sections' defaults (sections.py, run_sections.py, each
field documented there) < the TOML file (`--config job.toml`) < `--set section.key=value`
overrides < the named flags (`--sites`, `--ranks-per-site`, `--steps`, `--run-dir`). One
rule, applied in `load_config`. Unknown sections or keys fail loudly, naming the known ones."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from isthmus.deploy.config.model import resolved_model
from isthmus.deploy.config.run_sections import (
    CheckpointSection,
    ClusterSection,
    FailoverSection,
    RunSection,
    SecuritySection,
    SyncSection,
)
from isthmus.deploy.config.sections import (
    ConfigError,
    DataSection,
    JobSection,
    ModelSection,
    ParallelSection,
    TopologySection,
    TrainSection,
)
from isthmus.deploy.config.validation import check_eval_batch, check_layout, check_train
from isthmus.deploy.config.values import coerce, read_toml, toml_string
from isthmus.deploy.config.wan_section import WanSection
from isthmus.inter.data import CODEC_FORMAT, connections_for_link, sync_chunk_bytes
from isthmus.intra.layout import ParallelConfig, ParallelLayout
from isthmus.intra.model_config import PRESET_TRAINING, ModelConfig


class CoordinatorOptions(TypedDict):
    """The `CoordinatorSettings` fields a job's config sets the same at every site."""

    heartbeat_s: float
    failure_timeout_s: float
    min_sites: int
    quorum_wait_s: float
    vote_window: int
    first_step: int
    witness: str | None


@dataclass(kw_only=True, slots=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    topology: TopologySection = field(default_factory=TopologySection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    sync: SyncSection = field(default_factory=SyncSection)
    failover: FailoverSection = field(default_factory=FailoverSection)
    wan: WanSection = field(default_factory=WanSection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    security: SecuritySection = field(default_factory=SecuritySection)

    def coordinator_options(self) -> CoordinatorOptions:
        """The failover settings every coordinator of this job is built with."""
        f = self.failover
        return {
            "heartbeat_s": f.heartbeat_s,
            "failure_timeout_s": f.failure_timeout_s,
            "min_sites": f.min_sites,
            "quorum_wait_s": f.quorum_wait_s,
            # The most steps between two votes (an outer round's, with its delay), and slack.
            "vote_window": self.sync.inner_steps + self.sync.outer_delay + 16
            if self.sync.mode != "step"
            else 16,
            "first_step": max(0, self.checkpoint.resume_step),
            "witness": self.failover.witness or None,
        }

    def check(self) -> None:
        """Each section's checks and those that span sections (validation.py), the
        tokenizer's first: the model's vocabulary comes from it. Raises ConfigError."""
        t, tr, par = self.topology, self.train, self.parallel
        self.data.check_tokenizer()
        self.job.check()
        t.check()
        tr.check()
        check_train(t, tr, par, self.sync)
        par.check()
        model = self.resolved_model()  # its own errors name their model.* key
        check_layout(t, tr, par, model)
        self.data.check()
        self.sync.check(layers=model.n_layers)
        self.failover.check(sites=t.sites)
        self.wan.check(t.site_names)
        self.run.check()
        check_eval_batch(t, par, self.run)
        self.checkpoint.check(steps=self.job.steps)
        self.cluster.check(t)
        self.security.check()

    @property
    def site_names(self) -> list[str]:
        return self.topology.site_names

    @property
    def chunk_bytes(self) -> int:
        """The cross-site chunk size in use: sync.chunk_bytes, or sized from the link."""
        if self.sync.chunk_bytes:
            return self.sync.chunk_bytes
        bulk = self.sync.transport != "grpc"  # TLS or not: the bulk port runs inside it
        return sync_chunk_bytes(
            self.wan.bandwidth_mbit * 1e6,
            2 * self.one_way_latency_s,
            cuda=self.device_type == "cuda",
            bulk=bulk,
            unequal_sites=len(set(self.site_ranks)) > 1,
        )

    @property
    def lane_connections(self) -> int:
        """TCP connections per peer lane: sync.connections, or as many as fill the link."""
        if self.sync.connections:
            return self.sync.connections
        return connections_for_link(
            self.wan.bandwidth_mbit * 1e6,
            2 * self.one_way_latency_s,
            per_flow_bps=self.wan.per_flow_mbit * 1e6,
        )

    @property
    def device_type(self) -> str:
        """ "cuda" or "cpu": topology.device, with "auto" resolved on this machine."""
        if self.topology.device == "auto":
            # Without the NVIDIA driver's device node there is no CUDA, and the CLI
            # need not import torch (seconds on a small machine) to learn it.
            if not os.path.exists("/dev/nvidiactl"):
                return "cpu"
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.topology.device

    @property
    def one_way_latency_s(self) -> float:
        return self.wan.one_way_latency_s

    def resolved_model(self) -> ModelConfig:
        """The model this job trains (deploy/config/model.py). Raises ConfigError."""
        return resolved_model(self.model, self.data, seq_len=self.train.seq_len)

    @property
    def site_ranks(self) -> list[int]:
        """Each site's rank count, by site index."""
        return self.topology.site_ranks

    def ranks_of(self, site: str) -> int:
        return self.site_ranks[self.site_names.index(site)]

    def site_layout(self, site: str | None = None) -> ParallelLayout:
        """A site's pp × dp × cp × tp (dp from its rank count; the first site's when
        ``site`` is None). Raises ValueError."""
        t = self.topology
        ranks = self.ranks_of(site) if site is not None else self.site_ranks[0]
        return ParallelLayout.for_ranks(ranks, pp=t.pp, tp=t.tp, cp=t.cp)

    @property
    def site_accumulate(self) -> list[int]:
        """Each site's micro-batches per rank per step (train.accumulate)."""
        return self.train.site_accumulate(self.topology.sites)

    def site_units(self) -> list[int]:
        """Each site's micro-batches per step over its replicas (accumulate x dp): its
        share of the global batch, and the weight of its gradient."""
        return [m * dp for m, dp in zip(self.site_accumulate, self.topology.site_dp(), strict=True)]

    def parallel_config(self, *, cuda: bool) -> ParallelConfig:
        return self.parallel.config(cuda=cuda, expert_parallel=self.topology.ep)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self) -> str:
        """This config as TOML that `load_config` reads back to the same values."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if isinstance(value, dict):
                    items = (f"{k} = {toml_string(v)}" for k, v in value.items())
                    text = "{" + ", ".join(items) + "}"
                else:
                    text = toml_string(value) if isinstance(value, (bool, str)) else repr(value)
                lines.append(f"{key} = {text}")
            lines.append("")
        return "\n".join(lines)

    def fingerprint(self) -> dict[str, str]:
        """The keys every site of one job must agree on, flattened to strings.

        The emulated link (`wan`), where a run writes (`run`) and how sites reach
        each other (`cluster`) may differ per site."""
        out = {}
        for section, values in self.to_dict().items():
            if section in ("wan", "run", "model", "cluster", "security"):
                continue
            for key, value in values.items():
                out[f"{section}.{key}"] = str(value)
        # The model as built, so a preset and its explicit spelling agree and a
        # difference names the real shape ("model.dim=192 vs 256"), not an override.
        # Lanes refuse chunks of another size: sites must agree on the size in use.
        out["sync.chunk_bytes"] = str(self.chunk_bytes)
        # Lanes of two releases whose payloads are laid out otherwise cannot talk.
        out["sync.codec_format"] = str(CODEC_FORMAT)
        out["model.preset"] = self.model.preset
        # How often and where a site saves may differ; the step every site starts at may not.
        for key in ("every", "dir", "keep", "final"):
            del out[f"checkpoint.{key}"]
        # Whether links need TLS or a token, never where the secrets are or what they are.
        out["security.require_tls"] = str(self.security.require_tls)
        out["security.require_token"] = str(self.security.require_token)
        # Whether the job has a witness, not where each site reaches it.
        out["failover.witness"] = str(bool(self.failover.witness))
        # The tokenizer by kind and content (data.tokenizer_sha256, filled in by the
        # launcher: intra/corpus/cache.py), not by where each site keeps its file or cache.
        kind = self.data.tokenizer
        out["data.tokenizer"] = kind if kind in ("bytes", "bpe") else "file"
        del out["data.cache_dir"]
        if kind != "bpe":
            del out["data.vocab_size"]  # unused; model.vocab_size says what the model has
        for key, value in dataclasses.asdict(self.resolved_model()).items():
            out[f"model.{key}"] = str(value)
        # The user's script by content and arguments (filled in from --script by the
        # launcher: deploy/commands/local.py), not by where each site keeps it; none
        # for the built-in trainer, whose fingerprint stays as it was.
        if self.run.script_sha256:
            out["run.script_sha256"] = self.run.script_sha256
            out["run.script_args"] = self.run.script_args
        return out


SECTION_TYPES: dict[str, type] = {
    f.name: type(getattr(JobConfig(), f.name)) for f in dataclasses.fields(JobConfig)
}
"""Each section's name and its class, in the order `isthmus config` prints them."""


def _apply(config: JobConfig, section: str, key: str, value: Any, origin: str) -> None:
    section_type = SECTION_TYPES.get(section)
    if section_type is None:
        known = ", ".join(SECTION_TYPES)
        raise ConfigError(f"unknown config section '{section}' ({origin}); known sections: {known}")
    target = getattr(config, section)
    names = [f.name for f in dataclasses.fields(section_type)]
    key, _, sub = key.partition(".")
    if key in names and isinstance(getattr(target, key), dict):
        _apply_mapping(target, section, key, sub, value, origin)
        return
    if sub:
        raise ConfigError(f"config key '{section}.{key}' has no sub-keys ({origin})")
    if key not in names:
        raise ConfigError(
            f"unknown config key '{section}.{key}' ({origin}); keys of [{section}]: {', '.join(names)}"
        )
    setattr(target, key, coerce(section, key, value, getattr(target, key)))


def _apply_mapping(target: Any, section: str, key: str, sub: str, value: Any, origin: str) -> None:
    # Mapping fields take a whole TOML table, or one entry as section.key.NAME=VALUE.
    where = f"{section}.{key}"
    entries = {sub: value} if sub else value
    if not isinstance(entries, dict):
        raise ConfigError(f'{where} must be a table of name = "value" ({origin})')
    numbers = "float" in str(next(f.type for f in dataclasses.fields(target) if f.name == key))
    for name, item in entries.items():
        if numbers and name:  # a price: a TOML number, or one given as --set text
            item = coerce(section, f"{key}.{name}", item, 0.0)
        elif not isinstance(item, str) or not name:
            raise ConfigError(f"{where}.{name} must be a string, got {item!r} ({origin})")
        getattr(target, key)[name] = item


def parse_override(text: str) -> tuple[str, str, str]:
    """Split "section.key=value" into its parts, or raise ConfigError."""
    name, sep, value = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    return section, key.strip(), value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    flags: dict[str, Any] | None = None,
    fit: Callable[[JobConfig, set[str]], None] | None = None,
) -> JobConfig:
    """Build and validate a job config (precedence in the module docstring).

    Args:
        flags: "section.key" -> value from the named flags; None values are skipped.
        fit: changes settings the sources left unset (given the keys they named),
            before validation (`isthmus local` fits the host: deploy/launch/quickstart.py).
    Raises:
        ConfigError: unknown keys, wrong types, invalid values; the message names the key."""
    config = JobConfig()
    given: set[str] = set()  # section.key the file, --set or flags named
    if path is not None:
        for section, values in read_toml(path).items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
            for key, value in values.items():
                _apply(config, section, key, value, str(path))
                given.add(f"{section}.{key}")
    for text in overrides or []:
        section, key, value = parse_override(text)
        _apply(config, section, key, value, f"--set {text}")
        given.add(f"{section}.{key}")
    for name, value in (flags or {}).items():
        if value is not None:
            section, key = name.split(".", 1)
            _apply(config, section, key, value, "command line")
            given.add(name)
    if config.wan.probe:
        print(config.wan.take_probe(), file=sys.stderr)
    apply_preset_training(config, given)
    if fit is not None:
        fit(config, given)
    _normalize_switches(config)
    config.check()
    return config


def apply_preset_training(config: JobConfig, given: set[str]) -> None:
    """The preset's learning rate, warmup, batch and sequence length
    (intra/model_config.py, PRESET_TRAINING) for each train key the job left unset: a
    1b model does not train well at a 1.9M-parameter model's learning rate."""
    defaults = PRESET_TRAINING.get(config.model.preset)
    if defaults is None:
        return  # an unknown preset is refused by validation, naming the known ones
    for key, value in (
        ("lr", defaults.lr),
        ("lr_reference_dp", defaults.reference_dp),
        ("warmup_steps", defaults.warmup_steps),
        ("batch_size", defaults.batch_size),
        ("seq_len", defaults.seq_len),
    ):
        if f"train.{key}" not in given:
            setattr(config.train, key, value)


def _normalize_switches(config: JobConfig) -> None:
    """Spell the auto/true/false keys one way, whatever the source wrote: a TOML
    boolean, "True", "yes". Sites compare these strings in the job fingerprint."""
    par = config.parallel
    for key in ("compile", "mixed_precision"):
        value = getattr(par, key).strip().lower()
        if value in ("true", "1", "yes"):
            value = "true"
        elif value in ("false", "0", "no"):
            value = "false"
        setattr(par, key, value)
    # One value for every site is spelled as one number, so `[2, 2]` and `2` make the
    # same fingerprint (a list of another length is left for validation to name).
    sites = config.topology.sites
    for section, key in (("topology", "ranks_per_site"), ("train", "accumulate")):
        value = getattr(getattr(config, section), key)
        if isinstance(value, list) and len(value) == sites and len(set(value)) == 1:
            setattr(getattr(config, section), key, value[0])
