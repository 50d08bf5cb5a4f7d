"""Typed job configuration: a TOML file plus command-line overrides.

Precedence, lowest first: the defaults written below < the TOML file
(`--config job.toml`) < `--set section.key=value` overrides < the named flags
(`--sites`, `--ranks-per-site`, `--steps`, `--run-dir`). One rule, applied in
`load_config`. Unknown sections or keys fail loudly, naming the known ones.

Every field is documented where it is defined; `isthmus config` prints the
resolved configuration with these docs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isthmus.deploy.sections import (
    KIB,
    SECTION_TYPES,
    CheckpointSection,
    ClusterSection,
    DataSection,
    FailoverSection,
    JobSection,
    ModelSection,
    ParallelSection,
    RunSection,
    SecuritySection,
    SyncSection,
    TopologySection,
    TrainSection,
    WanSection,
)
from isthmus.inter.chunk_size import chunk_bytes_for_link
from isthmus.inter.codec_spec import parse_codec_spec
from isthmus.inter.security import SiteSecurity
from isthmus.intra.layout import ParallelConfig, ParallelLayout
from isthmus.intra.model_config import ModelConfig, preset

CUDA_BULK_CHUNK_BYTES = 16 << 20
"""The least auto chunk for CUDA tensors on the bulk transport (see ``chunk_bytes``)."""
MAX_SYNC_CHUNK_BYTES = 64 << 20
"""The largest ``sync.chunk_bytes`` a job (or the all-reduce benchmark) may set."""
SYNC_MODES = ("step", "diloco")
"""What ``sync.mode`` may be (``SyncSection.mode`` says what each does)."""

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib  # type: ignore[no-redef]


class ConfigError(ValueError):
    """A user's configuration is wrong; the message says what and where."""


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

    def coordinator_options(self) -> dict[str, float | int]:
        """The failover settings every coordinator of this job is built with."""
        f = self.failover
        return {
            "heartbeat_s": f.heartbeat_s,
            "failure_timeout_s": f.failure_timeout_s,
            "min_sites": f.min_sites,
            "quorum_wait_s": f.quorum_wait_s,
        }

    @property
    def site_names(self) -> list[str]:
        return [f"site{i}" for i in range(self.topology.sites)]

    @property
    def chunk_bytes(self) -> int:
        """The cross-site chunk size in use: sync.chunk_bytes, or sized from the link."""
        if self.sync.chunk_bytes:
            return self.sync.chunk_bytes
        size = chunk_bytes_for_link(self.wan.bandwidth_mbit * 1e6, 2 * self.one_way_latency_s)
        bulk = self.sync.transport == "bulk" or (
            self.sync.transport == "auto" and not self.security.require_tls
        )
        if bulk and self.device_type == "cuda":
            # A CUDA chunk costs a dozen kernel launches, each under the GIL that the
            # lane's threads share, and gRPC's message limit does not apply to the bulk
            # port: at 4 MiB the launches, not the link, bounded the sync (issue 11: the
            # 1b gradient over 2 lanes took 1.92 s at 4 MiB, 1.05 s at 16 MiB).
            size = max(size, CUDA_BULK_CHUNK_BYTES)
        return size

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
        if self.wan.latency_ms >= 0:
            return self.wan.latency_ms / 1000.0
        return self.wan.distance_km * 4.9e-6

    def resolved_model(self) -> ModelConfig:
        """The preset with this config's overrides; max_seq_len covers train.seq_len.

        Raises:
            ConfigError: an unknown preset or a shape the model refuses.
        """
        try:
            cfg = preset(self.model.preset)
            if self.model.dim:
                cfg.dim = self.model.dim
                # Keep the SwiGLU hidden size at ~8/3 dim, rounded up to a multiple of 8.
                cfg.ffn_hidden = -(-int(8 * cfg.dim / 3) // 8) * 8
            if self.model.n_layers:
                cfg.n_layers = self.model.n_layers
            if self.model.n_heads:
                cfg.n_heads = self.model.n_heads
            cfg.max_seq_len = max(cfg.max_seq_len, self.train.seq_len)
            cfg.__post_init__()  # re-validate after the overrides
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
        return cfg

    def parallel_config(self, *, cuda: bool) -> ParallelConfig:
        """The site's parallelism choices for intra's Trainer."""
        p = self.parallel
        return ParallelConfig(
            schedule=p.schedule,
            microbatches=p.microbatches or None,
            stages_per_rank=p.stages_per_rank or None,
            sequence_parallel=p.sequence_parallel,
            activation_checkpoint=p.activation_checkpoint,
            # Compiled blocks reach ~49% MFU at the 1b preset on an H100 against ~32%
            # eager (benchmarks/site_step.py), so CUDA compiles unless told not to.
            compile=cuda if p.compile == "auto" else p.compile == "true",
            mixed_precision=cuda if p.mixed_precision == "auto" else p.mixed_precision == "true",
        )

    def site_security(self, site: str, run_token: str | None = None) -> SiteSecurity | None:
        """The site's credentials for its servers and channels; None when all is off.

        Args:
            site: the site.
            run_token: a token the launcher made for this run (``isthmus local``, handed
                to its ranks as ISTHMUS_RUN_TOKEN); required on every call when the
                [security] section asks for nothing itself.

        Raises:
            ConfigError: a file the [security] switches need is missing (named).
        """
        sec = self.security
        if not (sec.require_tls or sec.require_token):
            return SiteSecurity(require_token=True, token=run_token) if run_token else None
        try:
            return SiteSecurity.load(
                sec.certs_dir,
                site,
                token_file=sec.token_file or None,
                require_tls=sec.require_tls,
                require_token=sec.require_token,
            )
        except ValueError as exc:
            raise ConfigError(f"security: {exc}") from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def fingerprint(self) -> dict[str, str]:
        """The keys every site of one job must agree on, flattened to strings.

        The emulated link (`wan`), where a run writes (`run`) and how sites reach
        each other (`cluster`) may differ per site.
        """
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
        out["model.preset"] = self.model.preset
        # How often and where a site saves may differ; the step every site starts at may not.
        for key in ("every", "dir", "keep"):
            del out[f"checkpoint.{key}"]
        # Whether links need TLS or a token, never where the secrets are or what they are.
        out["security.require_tls"] = str(self.security.require_tls)
        out["security.require_token"] = str(self.security.require_token)
        for key, value in dataclasses.asdict(self.resolved_model()).items():
            out[f"model.{key}"] = str(value)
        return out


def _coerce(section: str, key: str, raw: Any, expected: Any) -> Any:
    where = f"{section}.{key}"
    kind = type(expected)
    if isinstance(raw, str) and kind is not str:
        text = raw.strip()
        try:
            raw = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            raw = text
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
    setattr(target, key, _coerce(section, key, value, getattr(target, key)))


def _apply_mapping(target: Any, section: str, key: str, sub: str, value: Any, origin: str) -> None:
    # Mapping fields take a whole TOML table, or one entry as section.key.NAME=VALUE.
    where = f"{section}.{key}"
    entries = {sub: value} if sub else value
    if not isinstance(entries, dict):
        raise ConfigError(f'{where} must be a table of name = "value" ({origin})')
    for name, item in entries.items():
        if not isinstance(item, str) or not name:
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
) -> JobConfig:
    """Build and validate a job config (precedence in the module docstring).

    Args:
        path: optional TOML file with [section] tables.
        overrides: "section.key=value" strings from --set.
        flags: "section.key" -> value from the named flags; None values are skipped.
    Returns:
        The validated JobConfig.
    Raises:
        ConfigError: unknown keys, wrong types, invalid values; the message names the key.
    """
    config = JobConfig()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
            for key, value in values.items():
                _apply(config, section, key, value, str(path))
    for text in overrides or []:
        section, key, value = parse_override(text)
        _apply(config, section, key, value, f"--set {text}")
    for name, value in (flags or {}).items():
        if value is not None:
            section, key = name.split(".", 1)
            _apply(config, section, key, value, "command line")
    _normalize_switches(config)
    validate(config)
    return config


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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: JobConfig) -> None:
    """Check values and their combinations; raise ConfigError naming the key."""
    t = config.topology
    _require(config.job.steps >= 1, f"job.steps must be >= 1, got {config.job.steps}")
    _require(1 <= t.sites <= 64, f"topology.sites must be in 1..64, got {t.sites}")
    _require(t.ranks_per_site >= 1, f"topology.ranks_per_site must be >= 1, got {t.ranks_per_site}")
    _require(
        t.pp >= 1 and t.tp >= 1, f"topology.pp and topology.tp must be >= 1, got {t.pp}, {t.tp}"
    )
    _require(
        t.ranks_per_site % (t.pp * t.tp) == 0,
        f"layout does not divide the ranks: topology.ranks_per_site={t.ranks_per_site} "
        f"is not divisible by pp*tp={t.pp}*{t.tp}={t.pp * t.tp}",
    )
    _require(
        t.device in ("auto", "cpu", "cuda"),
        f"topology.device must be auto, cpu or cuda, got {t.device!r}",
    )
    tr = config.train
    _require(tr.batch_size >= 1, f"train.batch_size must be >= 1, got {tr.batch_size}")
    _require(tr.seq_len >= 2, f"train.seq_len must be >= 2, got {tr.seq_len}")
    _require(tr.lr > 0, f"train.lr must be > 0, got {tr.lr}")
    _require(tr.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {tr.warmup_steps}")
    _require(tr.grad_clip >= 0, f"train.grad_clip must be >= 0, got {tr.grad_clip}")
    _require(
        tr.lr_scaling in ("sqrt", "linear", "none"),
        f"train.lr_scaling must be sqrt, linear or none, got {tr.lr_scaling!r}",
    )
    _require(
        tr.lr_reference_dp >= 1, f"train.lr_reference_dp must be >= 1, got {tr.lr_reference_dp}"
    )
    par = config.parallel
    for key in ("compile", "mixed_precision"):
        _require(
            getattr(par, key) in ("auto", "true", "false"),
            f"parallel.{key} must be auto, true or false, got {getattr(par, key)!r}",
        )
    try:
        config.parallel_config(cuda=False).check(
            ParallelLayout.for_ranks(t.ranks_per_site, pp=t.pp, tp=t.tp),
            config.resolved_model(),
            batch_size=tr.batch_size,
            seq_len=tr.seq_len,
        )
    except ValueError as exc:
        raise ConfigError(f"parallel: {exc}") from None
    d = config.data
    _require(
        d.source in ("stdlib", "path"), f"data.source must be stdlib or path, got {d.source!r}"
    )
    _require(d.source != "path" or bool(d.path), "data.source = 'path' needs data.path")
    _require(d.max_bytes >= 1024, f"data.max_bytes must be >= 1024, got {d.max_bytes}")
    s = config.sync
    _require(
        s.chunk_bytes == 0
        or (4 * KIB <= s.chunk_bytes <= MAX_SYNC_CHUNK_BYTES and s.chunk_bytes % 4 == 0),
        f"sync.chunk_bytes must be 0 (auto) or a multiple of 4 in 4 KiB..64 MiB, got {s.chunk_bytes}",
    )
    _require(0 <= s.workers <= 64, f"sync.workers must be in 0..64, got {s.workers}")
    try:
        parse_codec_spec(s.codec)
    except ValueError as exc:
        raise ConfigError(f"sync.codec: {exc}") from None
    _require(1 <= s.connections <= 16, f"sync.connections must be in 1..16, got {s.connections}")
    _require(
        s.transport in ("auto", "bulk", "grpc"),
        f'sync.transport must be "auto", "bulk" or "grpc", got {s.transport!r}',
    )
    _require(
        1 <= s.rounds_in_flight <= 64,
        f"sync.rounds_in_flight must be in 1..64, got {s.rounds_in_flight}",
    )
    _require(s.timeout_s > 0, f"sync.timeout_s must be > 0, got {s.timeout_s}")
    _require(
        s.mode in SYNC_MODES,
        f"sync.mode must be one of {', '.join(SYNC_MODES)}, got {s.mode!r}",
    )
    _require(s.inner_steps >= 1, f"sync.inner_steps must be >= 1, got {s.inner_steps}")
    _require(s.outer_lr > 0, f"sync.outer_lr must be > 0, got {s.outer_lr}")
    _require(
        0 <= s.outer_momentum < 1,
        f"sync.outer_momentum must be in [0, 1), got {s.outer_momentum}",
    )
    _require(
        0 <= s.outer_delay < s.inner_steps,
        f"sync.outer_delay must be in 0..inner_steps-1 = 0..{s.inner_steps - 1}, "
        f"got {s.outer_delay}",
    )
    f = config.failover
    _require(
        1 <= f.min_sites <= config.topology.sites,
        f"failover.min_sites must be in 1..topology.sites={config.topology.sites}, got {f.min_sites}",
    )
    _require(
        0 < f.heartbeat_s < f.failure_timeout_s,
        f"failover.heartbeat_s must be > 0 and below failover.failure_timeout_s, got "
        f"{f.heartbeat_s} and {f.failure_timeout_s}",
    )
    _require(f.quorum_wait_s >= 0, f"failover.quorum_wait_s must be >= 0, got {f.quorum_wait_s}")
    config.resolved_model()
    w = config.wan
    _require(w.distance_km >= 0, f"wan.distance_km must be >= 0, got {w.distance_km}")
    _require(w.bandwidth_mbit > 0, f"wan.bandwidth_mbit must be > 0, got {w.bandwidth_mbit}")
    _require(w.queue_kib >= 0, f"wan.queue_kib must be >= 0, got {w.queue_kib}")
    _require(
        config.run.digest_every >= 0,
        f"run.digest_every must be >= 0, got {config.run.digest_every}",
    )
    _require(
        config.run.steady_after >= 0,
        f"run.steady_after must be >= 0, got {config.run.steady_after}",
    )
    _require(
        -1 <= config.run.metrics_port <= 65535,
        f"run.metrics_port must be -1 (none), 0 (any) or a port, got {config.run.metrics_port}",
    )
    ck = config.checkpoint
    _require(ck.every >= 0, f"checkpoint.every must be >= 0 (0 = never), got {ck.every}")
    _require(ck.keep >= 0, f"checkpoint.keep must be >= 0 (0 = all), got {ck.keep}")
    _require(
        -1 <= ck.resume_step < config.job.steps,
        f"checkpoint.resume_step must be -1 (from scratch) or a step below "
        f"job.steps={config.job.steps}, got {ck.resume_step}",
    )
    c = config.cluster
    _require(
        c.lane_port_base == 0 or 1024 <= c.lane_port_base <= 65535 - config.topology.ranks_per_site,
        f"cluster.lane_port_base must be 0 or leave room for every rank below 65536, got {c.lane_port_base}",
    )
    _require(
        not (
            c.lane_host in ("0.0.0.0", "::") and not c.advertise_host and config.topology.sites > 1
        ),
        f"cluster.lane_host = {c.lane_host!r} binds every interface: set cluster.advertise_host "
        "to the address peers reach this site at",
    )
    for key in ("coordinators", "proxies"):
        unknown = sorted(set(getattr(config.cluster, key)) - set(config.site_names))
        _require(
            not unknown,
            f"cluster.{key} names unknown sites {unknown}; sites are {config.site_names}",
        )
    sec = config.security
    _require(
        not sec.require_tls or bool(sec.certs_dir),
        "security.require_tls needs security.certs_dir (create one with `isthmus certs`)",
    )
    _require(
        not sec.require_token or bool(sec.certs_dir or sec.token_file),
        "security.require_token needs security.token_file or security.certs_dir",
    )
    if sec.require_tls:
        ca = Path(sec.certs_dir) / "ca.crt"
        _require(ca.is_file(), f"security.certs_dir: no CA certificate {ca}")
    if sec.require_token:
        token = Path(sec.token_file) if sec.token_file else Path(sec.certs_dir) / "token"
        _require(token.is_file(), f"security: no job token file {token}")
    _require(
        config.run.log_level in ("debug", "info", "warning", "error"),
        f"run.log_level must be debug, info, warning or error, got {config.run.log_level!r}",
    )
