"""The sections of how a job's sites run and reach each other (sync, failover, wan,
cluster, security) and where it writes (run, checkpoint); sections.py says how a
section documents its fields and checks its values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from isthmus.deploy.config.sections import (
    KIB,
    SHA256_RULE,
    ConfigError,
    TopologySection,
    at_least,
    is_sha256,
    one_of,
    positive,
    require,
)
from isthmus.inter.data import parse_codec_spec

MAX_SYNC_CHUNK_BYTES = 64 << 20
"""The largest ``sync.chunk_bytes`` a job (or the all-reduce benchmark) may set."""
SYNC_MODES = ("step", "diloco", "streaming")
"""What ``sync.mode`` may be (``SyncSection.mode`` says what each does)."""


@dataclass(kw_only=True, slots=True)
class SyncSection:
    mode: str = "step"
    """How the sites combine their work: "step" averages the gradient across sites every
    step; "diloco" lets each site take inner_steps steps alone, then averages how far
    the parameters moved (the outer gradient) and applies it with outer_lr and
    outer_momentum (DiLoCo); "streaming" does the same for one of `fragments` strided
    groups of blocks at a time, every inner_steps/fragments steps (Streaming DiLoCo;
    docs/sync-modes.md)."""
    inner_steps: int = 50
    """diloco, streaming: H, the steps each site trains alone between outer steps (the
    job's last step always ends with one, of every fragment)."""
    outer_lr: float = 0.7
    """diloco, streaming: learning rate of the outer Nesterov SGD (DiLoCo's default)."""
    outer_momentum: float = 0.9
    """diloco, streaming: Nesterov momentum of the outer SGD; 0 = none."""
    outer_lr_ramp: float = 1.0
    """diloco, streaming: the outer learning rate at the end of the inner learning
    rate's cosine, as a multiple of outer_lr; in between it rises as the inner one
    decays (docs/sync-modes.md). 1 = outer_lr throughout."""
    outer_delay: int = 0
    """diloco, streaming: inner steps an outer all-reduce runs behind, in
    0..inner_steps/fragments-1: the sites train on while it crosses and its average
    lands that many steps later, merged with the progress made meanwhile (diloco: added
    under it; streaming: mixed by fragment_alpha). 0 = each outer step waits for it."""
    fragments: int = 2
    """streaming: P, fragments of the blocks (block i in fragment i mod P), synced one at
    a time, fragment k at (k+1)*inner_steps/fragments steps into each inner_steps; must
    divide inner_steps and be at most the model's layers."""
    fragment_alpha: float = 0.5
    """streaming: a fragment landing outer_delay steps late becomes
    fragment_alpha*local + (1-fragment_alpha)*average (Streaming DiLoCo's mixing;
    0 = the average only). Unused without a delay."""
    codec: str = "raw+shuffle+zstd:1"
    """Cross-site codec chain TENSOR[+shuffle][+zstd[:LEVEL[:THREADS]]]; TENSOR is raw
    (fp32, lossless), bf16, int8 or int4 (a scale per 1024 values, error feedback; int4
    packs two values per byte, for DiLoCo's outer gradients). Examples:
    "raw", "bf16+shuffle+zstd:3", "int8+zstd:1"."""
    chunk_bytes: int = 0
    """Raw bytes per chunk of the cross-site all-reduce; 0 = the link's bandwidth-delay
    product (from wan.*), clamped to 256 KiB - 4 MiB, and at least 16 MiB for CUDA
    tensors on the bulk transport (fewer, larger chunks: fewer kernel launches)."""
    connections: int = 0
    """TCP connections per peer lane (bulk or gRPC), 1..16; 0 = as many as fill the link:
    bandwidth / wan.per_flow_mbit, or the bandwidth-delay product over one connection's
    TCP window, at least 2 (inter/data/transport/chunk_size.py, ``connections_for_link``)."""
    transport: str = "auto"
    """How chunks travel: "bulk" (the lanes' own TCP port, inside mutual TLS when
    security.require_tls is on; fastest), "grpc" (PushChunks calls) or "auto" (bulk;
    see docs/wire.md)."""
    rounds_in_flight: int = 4
    """FSDP groups whose cross-site rounds may run at once, overlapping each other and
    backward; 1 runs them one after another."""
    workers: int = 0
    """Encode/decode threads per lane; 0 = min(4, cores)."""
    timeout_s: float = 120.0
    """Deadline for one cross-site round and for joining; a silent peer fails the step."""

    def check(self, *, layers: int) -> None:
        """sync.*, the outer round's period included; ``layers``: the model's."""
        chunk = self.chunk_bytes
        require(
            chunk == 0 or (4 * KIB <= chunk <= MAX_SYNC_CHUNK_BYTES and chunk % 4 == 0),
            f"sync.chunk_bytes must be 0 (auto) or a multiple of 4 in 4 KiB..64 MiB, got {chunk}",
        )
        require(0 <= self.workers <= 64, f"sync.workers must be in 0..64, got {self.workers}")
        try:
            parse_codec_spec(self.codec)
        except ValueError as exc:
            raise ConfigError(f"sync.codec: {exc}") from None
        require(
            0 <= self.connections <= 16,
            f"sync.connections must be in 1..16, or 0 to fill the link, got {self.connections}",
        )
        require(
            self.transport in ("auto", "bulk", "grpc"),
            f'sync.transport must be "auto", "bulk" or "grpc", got {self.transport!r}',
        )
        require(
            1 <= self.rounds_in_flight <= 64,
            f"sync.rounds_in_flight must be in 1..64, got {self.rounds_in_flight}",
        )
        positive("sync", self, "timeout_s")
        require(
            self.mode in SYNC_MODES,
            f"sync.mode must be one of {', '.join(SYNC_MODES)}, got {self.mode!r}",
        )
        inner = self.inner_steps
        at_least("sync", self, inner_steps=1)
        positive("sync", self, "outer_lr", "outer_lr_ramp")
        require(
            0 <= self.outer_momentum < 1,
            f"sync.outer_momentum must be in [0, 1), got {self.outer_momentum}",
        )
        period = inner
        if self.mode == "streaming":
            require(
                1 <= self.fragments <= min(layers, inner) and inner % self.fragments == 0,
                f"sync.fragments must divide sync.inner_steps={inner} and be at most the "
                f"model's {layers} layers, got {self.fragments}",
            )
            require(
                0 <= self.fragment_alpha <= 1,
                f"sync.fragment_alpha must be in [0, 1], got {self.fragment_alpha}",
            )
            period = inner // self.fragments
        require(
            0 <= self.outer_delay < period,
            f"sync.outer_delay must be in 0..{period - 1} (below inner_steps"
            f"{'/fragments' if self.mode == 'streaming' else ''} = {period}), got {self.outer_delay}",
        )


@dataclass(kw_only=True, slots=True)
class FailoverSection:
    min_sites: int = 1
    """Never train with fewer live sites than this; below it the job stops."""
    failure_timeout_s: float = 10.0
    """The most a site may be silent (no coordinator heartbeat) before it is taken for
    dead: the others finish the step's rounds without it and carry on. Each site's own
    deadline is learned from its heartbeats' arrivals (at least 4 periods; longer for a
    jittery, lossy link or a stalled host): 4 s by default, about a second at 0.2 s."""
    heartbeat_s: float = 1.0
    """Period of the heartbeats between coordinators (and of the pings to the witness)."""
    quorum_wait_s: float = 300.0
    """How long a site cut off from a quorum waits for the link to heal (then it
    pulls the state and rejoins) before it stops with a message saying why."""
    witness: str = ""
    """host:port of the job's witness (`isthmus witness`, at a third place): a side
    holding exactly half the sites goes on only with its grant, so two sites survive
    the loss of either. Empty = none: an even split goes on on the side with site0."""

    def check(self, *, sites: int) -> None:
        require(
            1 <= self.min_sites <= sites,
            f"failover.min_sites must be in 1..topology.sites={sites}, got {self.min_sites}",
        )
        require(
            0 < self.heartbeat_s < self.failure_timeout_s,
            f"failover.heartbeat_s must be > 0 and below failover.failure_timeout_s, got "
            f"{self.heartbeat_s} and {self.failure_timeout_s}",
        )
        at_least("failover", self, quorum_wait_s=0)
        host, _, port = self.witness.rpartition(":")
        require(
            not self.witness or (bool(host) and port.isdigit()),
            f"failover.witness must be HOST:PORT, got {self.witness!r}",
        )


@dataclass(kw_only=True, slots=True)
class RunSection:
    run_dir: str = ""
    """Where the resolved config, metrics.jsonl, summary.json and logs go; empty = a temp dir."""
    log_level: str = "warning"
    """Log level of the rank processes: debug, info, warning, error."""
    digest_every: int = 10
    """Compare parameter digests across sites every this many steps (and after the
    last); 0 = only after the last. Each digest gathers the full parameters."""
    metrics_port: int = 0
    """Prometheus /metrics port of each coordinator; 0 = any free port, -1 = none."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard/SITE (needs tensorboard)."""
    eval_every: int = 50
    """Measure the held-out loss every this many steps and after the last (in
    metrics.jsonl, TensorBoard, the progress line and summary.json as val_loss); 0 =
    only after the last. The outer modes measure the sites' shared model (the anchors)."""
    eval_batches: int = 16
    """Held-out batches per measurement (EVAL_BATCH = 8 windows of train.seq_len each,
    whatever the per-rank batch, so layouts compare), the same ones every time and at
    every site; 0 = no held-out loss."""
    share_gpus: bool = False
    """`isthmus local` only: sites take turns on this host's GPUs. A site whose ranks
    would run past the last GPU starts again at GPU 0, so one GPU runs two one-rank
    sites. The sites then share compute: for loss and correctness, not for speed."""
    steady_after: int = 2
    """Steps left out of the summary's steady-state figures (steady tokens/s, MFU,
    exposed sync per step): the first steps compile kernels and warm up allocators and
    links. With fewer steps than this + 1, only the first step is left out."""
    host_agent: bool = True
    """A launcher that starts several ranks of a site on its host (`isthmus local`,
    `isthmus site`) runs one agent beside them: their votes reach the coordinator as one
    message a step and their watches as one poll (inter/control/host_agent.py). Off:
    each rank votes and watches on its own (what ranks started by srun do)."""
    oversubscribe: bool = False
    """Run more CPU ranks on this host than max(8, 4 x its cores) (`--oversubscribe`
    sets it); off, such a job is refused before it starts (deploy/config/host_check.py,
    ``host_problem``, says why those numbers)."""
    script_sha256: str = ""
    """sha256 of the `--script` file's bytes, filled in by the launcher (set here, it
    pins the script: a --script that hashes otherwise is refused). Part of the job
    fingerprint with script_args: sites running other scripts are refused at join.
    Empty = the built-in trainer."""
    script_args: str = ""
    """The script's arguments (after `--`) as a JSON list, filled in by the launcher
    with script_sha256 (set here, it pins them too)."""

    def check(self) -> None:
        """run.* (validation.py checks the held-out batch against the pipeline)."""
        sha = self.script_sha256
        require(is_sha256(sha), f"run.script_sha256 must be {SHA256_RULE}, got {sha!r}")
        at_least("run", self, digest_every=0, steady_after=0)
        require(
            self.eval_every >= 0 and self.eval_batches >= 0,
            f"run.eval_every and run.eval_batches must be >= 0, got {self.eval_every} "
            f"and {self.eval_batches}",
        )
        require(
            -1 <= self.metrics_port <= 65535,
            f"run.metrics_port must be -1 (none), 0 (any) or a port, got {self.metrics_port}",
        )
        one_of("run", self, "log_level", "debug", "info", "warning", "error")


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    every: int = 0
    """Save a checkpoint of every site after each this many steps; 0 = never."""
    dir: str = ""
    """Checkpoints of site SITE go to DIR/SITE; empty = RUN_DIR/checkpoints/SITE."""
    keep: int = 2
    """Complete checkpoints kept per site (the newest); 0 = keep all."""
    final: bool = True
    """Also save after the job's last step when the run is kept (``run.run_dir`` or
    ``checkpoint.dir`` set): the trained model, for `isthmus export` and `--resume`."""
    resume_step: int = -1
    """Start from the checkpoint after this many steps (complete at every site); -1 =
    from scratch. --resume sets it to the newest step complete at every site. Part of
    the job fingerprint: every site must start at the same step."""

    def check(self, *, steps: int) -> None:
        require(self.every >= 0, f"checkpoint.every must be >= 0 (0 = never), got {self.every}")
        require(self.keep >= 0, f"checkpoint.keep must be >= 0 (0 = all), got {self.keep}")
        require(
            -1 <= self.resume_step < steps,
            f"checkpoint.resume_step must be -1 (from scratch) or a step below "
            f"job.steps={steps}, got {self.resume_step}",
        )


@dataclass(kw_only=True, slots=True)
class ClusterSection:
    coordinators: dict[str, str] = field(default_factory=dict)
    """Site name -> host:port of its coordinator, for `isthmus site` (ignored by `local`).
    Set one with --set cluster.coordinators.site0=10.0.0.5:7070."""
    proxies: dict[str, str] = field(default_factory=dict)
    """Peer site -> HTTP CONNECT proxy URL this site reaches it through (an emulated
    link from `isthmus wan up`); empty = direct."""
    lane_host: str = "127.0.0.1"
    """Address this site's lanes bind (0.0.0.0 for every interface)."""
    lane_port_base: int = 0
    """Rank r's lane listens on lane_port_base + r (so a firewall or a Service can
    name the ports); 0 = any free port."""
    advertise_host: str = ""
    """Address peers use to reach this site's lanes (behind NAT or a load balancer);
    empty = lane_host."""

    def check(self, topology: TopologySection) -> None:
        """Ports, addresses and the sites they name."""
        base = self.lane_port_base
        require(
            base == 0 or 1024 <= base <= 65535 - max(topology.site_ranks),
            f"cluster.lane_port_base must be 0 or leave room for every rank below 65536, got {base}",
        )
        require(
            not (
                self.lane_host in ("0.0.0.0", "::")
                and not self.advertise_host
                and topology.sites > 1
            ),
            f"cluster.lane_host = {self.lane_host!r} binds every interface: set "
            "cluster.advertise_host to the address peers reach this site at",
        )
        for key in ("coordinators", "proxies"):
            unknown = sorted(set(getattr(self, key)) - set(topology.site_names))
            require(
                not unknown,
                f"cluster.{key} names unknown sites {unknown}; sites are {topology.site_names}",
            )


@dataclass(kw_only=True, slots=True)
class SecuritySection:
    certs_dir: str = ""
    """Folder written by `isthmus certs`: ca.crt, SITE.crt and SITE.key of this site,
    token. Needed when require_tls or require_token is on (docs/security.md)."""
    token_file: str = ""
    """File holding the job token; empty = CERTS_DIR/token."""
    require_tls: bool = False
    """Coordinators and lanes serve only mutual TLS and dial with it: a peer without a
    certificate signed by the job CA is refused in the handshake."""
    require_token: bool = False
    """Every call must carry the job token (health checks excepted); a refused call is
    logged with the peer's address."""
    insecure: bool = False
    """Let a site listen beyond loopback without require_tls and require_token (a
    warning every start); off, such a site refuses to start (`--insecure` sets it)."""

    def check(self) -> None:
        """security.*, and that the files it names are there."""
        require(
            not self.require_tls or bool(self.certs_dir),
            "security.require_tls needs security.certs_dir (create one with `isthmus certs`)",
        )
        require(
            not self.require_token or bool(self.certs_dir or self.token_file),
            "security.require_token needs security.token_file or security.certs_dir",
        )
        if self.require_tls:
            ca = Path(self.certs_dir) / "ca.crt"
            require(ca.is_file(), f"security.certs_dir: no CA certificate {ca}")
        if self.require_token:
            token = Path(self.token_file) if self.token_file else Path(self.certs_dir) / "token"
            require(token.is_file(), f"security: no job token file {token}")
