"""Checks of a job config's values and their combinations (``validate``), run by
``load_config`` once every source is applied; each refusal is a ConfigError naming
the key."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isthmus.deploy.config.sections import EVAL_BATCH, KIB
from isthmus.inter.data import parse_codec_spec
from isthmus.intra.layout import ParallelLayout
from isthmus.intra.tokenizer import MAX_VOCAB, MIN_BPE_VOCAB, file_facts, require_tokenizers

if TYPE_CHECKING:
    from isthmus.deploy.config.job import JobConfig
    from isthmus.deploy.config.sections import DataSection

MAX_SYNC_CHUNK_BYTES = 64 << 20
"""The largest ``sync.chunk_bytes`` a job (or the all-reduce benchmark) may set."""
SYNC_MODES = ("step", "diloco", "streaming")
"""What ``sync.mode`` may be (``SyncSection.mode`` says what each does)."""


class ConfigError(ValueError):
    """A user's configuration is wrong; the message says what and where."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: JobConfig) -> None:
    """Check values and their combinations, one section after another (a section's
    check reads the others its keys depend on); raise ConfigError naming the key."""
    _check_tokenizer(config.data)  # first: the model's vocabulary comes from it
    _require(config.job.steps >= 1, f"job.steps must be >= 1, got {config.job.steps}")
    _check_topology(config)
    _check_train(config)
    _check_parallel(config)
    _check_data(config)
    _check_sync(config)
    _check_failover(config)
    _check_wan(config)
    _check_run(config)
    _check_checkpoint(config)
    _check_cluster(config)
    _check_security(config)
    _require(
        config.run.log_level in ("debug", "info", "warning", "error"),
        f"run.log_level must be debug, info, warning or error, got {config.run.log_level!r}",
    )


def _check_topology(config: JobConfig) -> None:
    """topology.*: the sites, their sizes and each site's layout."""
    t = config.topology
    _require(1 <= t.sites <= 64, f"topology.sites must be in 1..64, got {t.sites}")
    sizes = t.ranks_per_site if isinstance(t.ranks_per_site, list) else [t.ranks_per_site]
    _require(
        not isinstance(t.ranks_per_site, list) or len(sizes) == t.sites,
        f"topology.ranks_per_site names {len(sizes)} site sizes {sizes} for "
        f"topology.sites={t.sites}: give one per site, or one number for all",
    )
    _require(
        all(n >= 1 for n in sizes), f"topology.ranks_per_site must be >= 1, got {t.ranks_per_site}"
    )
    _require(
        t.pp >= 1 and t.tp >= 1 and t.cp >= 1,
        f"topology.pp, topology.cp and topology.tp must be >= 1, got {t.pp}, {t.cp}, {t.tp}",
    )
    for n in sizes:
        _require(
            n % (t.pp * t.cp * t.tp) == 0,
            f"layout does not divide the ranks: topology.ranks_per_site={n} "
            f"is not divisible by pp*cp*tp={t.pp}*{t.cp}*{t.tp}={t.pp * t.cp * t.tp} "
            "(sites may differ in dp only: pp, cp and tp are the same at every site)",
        )
    _require(
        len(set(sizes)) == 1 or t.ep == 1,
        f"topology.ep={t.ep} needs sites of one size, got topology.ranks_per_site={sizes}: "
        "expert-parallel sites of different sizes are not supported yet",
    )
    _require(
        t.device in ("auto", "cpu", "cuda"),
        f"topology.device must be auto, cpu or cuda, got {t.device!r}",
    )


def _check_train(config: JobConfig) -> None:
    """train.*, and the batch schedule."""
    t, tr = config.topology, config.train
    _require(tr.batch_size >= 1, f"train.batch_size must be >= 1, got {tr.batch_size}")
    accumulate = tr.accumulate if isinstance(tr.accumulate, list) else [tr.accumulate]
    _require(
        not isinstance(tr.accumulate, list) or len(accumulate) == t.sites,
        f"train.accumulate names {len(accumulate)} values {accumulate} for "
        f"topology.sites={t.sites}: give one per site, or one number for all",
    )
    _require(all(m >= 1 for m in accumulate), f"train.accumulate must be >= 1, got {tr.accumulate}")
    _require(
        max(accumulate) == 1 or (t.pp == 1 and not config.parallel.offload),
        f"train.accumulate={tr.accumulate} needs topology.pp=1 and parallel.offload=false "
        f"(got pp={t.pp}, offload={config.parallel.offload}): pipelines have micro-batches "
        "of their own",
    )
    _require(tr.balance_every >= 0, f"train.balance_every must be >= 0, got {tr.balance_every}")
    _require(
        tr.balance_every == 0
        or (config.sync.mode == "step" and t.pp == 1 and not config.parallel.offload),
        f"train.balance_every={tr.balance_every} needs sync.mode=step, topology.pp=1 and "
        f"parallel.offload=false (got {config.sync.mode}, pp={t.pp}, "
        f"offload={config.parallel.offload}): the split moves micro-batches of per-step sync",
    )
    _check_batch_schedule(config)
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


def _check_parallel(config: JobConfig) -> None:
    """parallel.*, and the layout of each site size for the model and its batch."""
    t, tr = config.topology, config.train
    par = config.parallel
    for key in ("compile", "mixed_precision"):
        _require(
            getattr(par, key) in ("auto", "true", "false"),
            f"parallel.{key} must be auto, true or false, got {getattr(par, key)!r}",
        )
    model = config.resolved_model()  # its own errors name their model.* key
    try:
        for ranks in dict.fromkeys(config.site_ranks):  # each size once
            config.parallel_config(cuda=False).check(
                ParallelLayout.for_ranks(ranks, pp=t.pp, tp=t.tp, cp=t.cp),
                model,
                batch_size=tr.batch_size,
                seq_len=tr.seq_len,
            )
    except ValueError as exc:
        raise ConfigError(f"parallel: {exc}") from None


def _check_data(config: JobConfig) -> None:
    """data.* (the tokenizer's keys are checked first, by `_check_tokenizer`)."""
    d = config.data
    _require(
        d.source in ("stdlib", "path", "prepared"),
        f"data.source must be stdlib, path or prepared, got {d.source!r}",
    )
    _require(d.source == "stdlib" or bool(d.path), f"data.source = {d.source!r} needs data.path")
    _require(
        d.source != "prepared" or d.tokenizer not in ("bytes", "bpe"),
        'data.source = "prepared" needs data.tokenizer = the tokenizer.json it was prepared '
        f"with (e.g. {Path(d.path) / 'tokenizer.json'})",
    )
    _require(d.max_bytes >= 1024, f"data.max_bytes must be >= 1024, got {d.max_bytes}")
    _require(
        0 <= d.val_fraction <= 0.5, f"data.val_fraction must be in [0, 0.5], got {d.val_fraction}"
    )


def _check_sync(config: JobConfig) -> None:
    """sync.*, the outer round's period included."""
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
    _require(
        0 <= s.connections <= 16,
        f"sync.connections must be in 1..16, or 0 to fill the link, got {s.connections}",
    )
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
    _require(s.outer_lr_ramp > 0, f"sync.outer_lr_ramp must be > 0, got {s.outer_lr_ramp}")
    _require(
        0 <= s.outer_momentum < 1,
        f"sync.outer_momentum must be in [0, 1), got {s.outer_momentum}",
    )
    period = s.inner_steps
    if s.mode == "streaming":
        layers = config.resolved_model().n_layers
        _require(
            1 <= s.fragments <= min(layers, s.inner_steps) and s.inner_steps % s.fragments == 0,
            f"sync.fragments must divide sync.inner_steps={s.inner_steps} and be at most the "
            f"model's {layers} layers, got {s.fragments}",
        )
        _require(
            0 <= s.fragment_alpha <= 1,
            f"sync.fragment_alpha must be in [0, 1], got {s.fragment_alpha}",
        )
        period = s.inner_steps // s.fragments
    _require(
        0 <= s.outer_delay < period,
        f"sync.outer_delay must be in 0..{period - 1} (below inner_steps"
        f"{'/fragments' if s.mode == 'streaming' else ''} = {period}), got {s.outer_delay}",
    )


def _check_failover(config: JobConfig) -> None:
    """failover.*."""
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
    host, _, port = f.witness.rpartition(":")
    _require(
        not f.witness or (bool(host) and port.isdigit()),
        f"failover.witness must be HOST:PORT, got {f.witness!r}",
    )


def _check_wan(config: JobConfig) -> None:
    """wan.*: the emulated link."""
    w = config.wan
    _require(w.distance_km >= 0, f"wan.distance_km must be >= 0, got {w.distance_km}")
    _require(w.bandwidth_mbit > 0, f"wan.bandwidth_mbit must be > 0, got {w.bandwidth_mbit}")
    _require(w.queue_kib >= 0, f"wan.queue_kib must be >= 0, got {w.queue_kib}")
    _require(
        w.per_flow_mbit >= 0, f"wan.per_flow_mbit must be >= 0 (0 = no cap), got {w.per_flow_mbit}"
    )


def _check_run(config: JobConfig) -> None:
    """run.* but run.log_level (checked last, in `validate`)."""
    sha = config.run.script_sha256
    _require(
        not sha or (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)),
        f"run.script_sha256 must be empty or 64 lowercase hex digits, got {sha!r}",
    )
    _require(
        config.run.digest_every >= 0,
        f"run.digest_every must be >= 0, got {config.run.digest_every}",
    )
    _require(
        config.run.steady_after >= 0,
        f"run.steady_after must be >= 0, got {config.run.steady_after}",
    )
    _require(
        config.run.eval_every >= 0 and config.run.eval_batches >= 0,
        f"run.eval_every and run.eval_batches must be >= 0, got {config.run.eval_every} "
        f"and {config.run.eval_batches}",
    )
    if config.topology.pp > 1 and config.run.eval_batches:
        micro = config.parallel_config(cuda=False).num_microbatches(config.topology.pp)
        _require(
            EVAL_BATCH % micro == 0,
            f"the held-out batch of {EVAL_BATCH} windows is cut into parallel.microbatches="
            f"{micro} with pp > 1, which must divide it: set microbatches to 1, 2, 4 or 8, "
            f"or run.eval_batches=0 (no held-out loss)",
        )
    _require(
        -1 <= config.run.metrics_port <= 65535,
        f"run.metrics_port must be -1 (none), 0 (any) or a port, got {config.run.metrics_port}",
    )


def _check_checkpoint(config: JobConfig) -> None:
    """checkpoint.*."""
    ck = config.checkpoint
    _require(ck.every >= 0, f"checkpoint.every must be >= 0 (0 = never), got {ck.every}")
    _require(ck.keep >= 0, f"checkpoint.keep must be >= 0 (0 = all), got {ck.keep}")
    _require(
        -1 <= ck.resume_step < config.job.steps,
        f"checkpoint.resume_step must be -1 (from scratch) or a step below "
        f"job.steps={config.job.steps}, got {ck.resume_step}",
    )


def _check_cluster(config: JobConfig) -> None:
    """cluster.*: ports, addresses and the sites they name."""
    c = config.cluster
    _require(
        c.lane_port_base == 0 or 1024 <= c.lane_port_base <= 65535 - max(config.site_ranks),
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


def _check_security(config: JobConfig) -> None:
    """security.*, and that the files it names are there."""
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


def _check_tokenizer(d: DataSection) -> None:
    """data.tokenizer and the keys that go with it."""
    _require(
        MIN_BPE_VOCAB <= d.vocab_size <= MAX_VOCAB,
        f"data.vocab_size must be in {MIN_BPE_VOCAB}..{MAX_VOCAB} (ids fit uint16), got "
        f"{d.vocab_size}",
    )
    sha = d.tokenizer_sha256
    _require(
        not sha or (len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)),
        f"data.tokenizer_sha256 must be empty or 64 lowercase hex digits, got {sha!r}",
    )
    if d.tokenizer == "bytes":
        _require(
            not sha,
            'data.tokenizer_sha256 pins a BPE tokenizer; data.tokenizer = "bytes" has none '
            "(leave it empty)",
        )
        return
    _require(
        not (d.source == "path" and Path(d.path).suffix in (".bin", ".npy")),
        f"data.tokenizer = {d.tokenizer!r} is for text, and data.path {d.path!r} holds token "
        'ids already (.bin/.npy): leave data.tokenizer = "bytes"',
    )
    if d.tokenizer != "bpe":
        _require(
            Path(d.tokenizer).is_file(),
            f'data.tokenizer must be "bytes", "bpe" or the path of a tokenizer.json; '
            f"{d.tokenizer!r} is neither (no such file)",
        )
        try:
            file_facts(d.tokenizer)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"data.tokenizer: {exc}") from None
    if d.source == "prepared":
        return  # token ids already: the file is only hashed, never run
    try:
        require_tokenizers()
    except ValueError as exc:
        raise ConfigError(f"data.tokenizer = {d.tokenizer!r}: {exc}") from None


def _check_batch_schedule(config: JobConfig) -> None:
    """train.batch_schedule and its settings (deploy/batch/plan.py)."""
    tr, t = config.train, config.topology
    schedule = tr.batch_schedule
    _require(
        schedule in ("fixed", "ramp", "noise"),
        f"train.batch_schedule must be fixed, ramp or noise, got {schedule!r}",
    )
    if schedule == "fixed":
        return
    sizes = t.ranks_per_site if isinstance(t.ranks_per_site, list) else [t.ranks_per_site] * t.sites
    accumulate = tr.accumulate if isinstance(tr.accumulate, list) else [tr.accumulate] * t.sites
    dp = [n // (t.pp * t.cp * t.tp) for n in sizes]
    least = sum(dp)
    full = sum(m * d for m, d in zip(accumulate, dp, strict=True))
    _require(
        config.sync.mode == "step" and t.pp == 1 and not config.parallel.offload,
        f"train.batch_schedule={schedule} needs sync.mode=step, topology.pp=1 and "
        f"parallel.offload=false (got {config.sync.mode}, pp={t.pp}, "
        f"offload={config.parallel.offload})",
    )
    start = tr.batch_start or least
    _require(
        least <= start < full,
        f"train.batch_start={tr.batch_start} must lie in [{least}, {full}) micro-batches: "
        f"at least one per replica ({least}), below the full batch of train.accumulate "
        f"({full}; raise train.accumulate to leave the batch room to grow)",
    )
    if schedule == "ramp":
        _require(
            tr.batch_ramp_steps >= 1,
            f"train.batch_schedule=ramp needs train.batch_ramp_steps >= 1, got {tr.batch_ramp_steps}",
        )
    else:
        _require(
            t.sites >= 2 and tr.balance_every >= 1,
            f"train.batch_schedule=noise needs two or more sites and train.balance_every >= 1 "
            f"(got {t.sites} sites, balance_every={tr.balance_every}): each site's own mean "
            "gradient is the estimate's small batch, and the decisions ride on its rounds",
        )
