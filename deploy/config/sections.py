"""The sections of a job config, each a typed dataclass whose fields are documented
where they are defined (`isthmus config` prints these docs). Loading and precedence
live in job.py, the checks of the values in validation.py."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field

KIB = 1024
MIB = 1024 * KIB


@dataclass(kw_only=True, slots=True)
class JobSection:
    name: str = "isthmus"
    """Job name, shown in logs and part of the job fingerprint."""
    seed: int = 0
    """Seed for model initialisation and data sampling; identical on every site."""
    steps: int = 20
    """Optimizer steps to run."""


@dataclass(kw_only=True, slots=True)
class TopologySection:
    sites: int = 2
    """Number of sites (datacenters); named site0, site1, ..."""
    ranks_per_site: int | list[int] = 2
    """torch.distributed ranks (processes; GPUs on a GPU host) in each site: one number
    for every site, or one per site (`[4, 2]`: sites of different sizes, which differ in
    dp only; pp, cp and tp are the job's)."""
    pp: int = 1
    """Pipeline-parallel width inside a site; dp = ranks_per_site / (pp x cp x tp)."""
    tp: int = 1
    """Tensor-parallel width inside a site."""
    cp: int = 1
    """Context-parallel width inside a site: each sequence split over cp ranks (two
    chunks each, for even causal-attention work; train.seq_len divisible by 2 x cp)."""
    ep: int = 1
    """Expert-parallel width (mixture-of-experts presets): the experts split over ep
    dp ranks, tokens exchanged all-to-all; divides dp and the expert count."""
    device: str = "auto"
    """"cpu" (gloo), "cuda" (NCCL), or "auto": cuda where the host has a GPU, else cpu.
    `isthmus local` and `isthmus site` refuse a host with fewer GPUs than the ranks
    they start (with run.share_gpus: than the largest site's), naming the ways out."""


@dataclass(kw_only=True, slots=True)
class ModelSection:
    preset: str = "small"
    """Model preset: tiny, small, 125m, 350m, 1b, or a mixture of experts moe-tiny,
    moe-small, moe-125m, moe-350m (8 experts, top-2, as many active parameters as the
    dense preset)."""
    dim: int = 0
    """Hidden size; 0 keeps the preset's."""
    n_layers: int = 0
    """Decoder layers; 0 keeps the preset's."""
    n_heads: int = 0
    """Attention heads; 0 keeps the preset's."""
    hf_config: str = ""
    """A Hugging Face config.json of the Llama, Qwen2 or Mistral family: the model's
    shape (grouped-query attention, q/k/v biases, tied head, llama3 rope scaling, its
    vocabulary) comes from it instead of preset, dim, n_layers and n_heads
    (docs/models.md). "" = the preset."""
    capacity_factor: float = 0.0
    """Mixture of experts: 0 = dropless (every routed token computed). Above 0, each
    expert takes at most ceil(capacity_factor x tokens x top_k / n_experts) of a rank's
    routed tokens and drops those of lowest router probability beyond that."""
    init_from: str = ""
    """A Hugging Face model folder (config.json and model.safetensors, or its shards):
    training starts from its weights instead of job.seed's; hf_config defaults to its
    config.json. "" = random weights. --resume's checkpoint wins over it."""


@dataclass(kw_only=True, slots=True)
class TrainSection:
    batch_size: int = 8
    """Sequences per data-parallel rank per step; the global batch is sites x dp x this.
    Unset, the preset's (as are seq_len, lr, warmup_steps and lr_reference_dp:
    `isthmus config --set model.preset=NAME` shows them; intra/model_config.py,
    PRESET_TRAINING, says where each comes from)."""
    seq_len: int = 128
    """Tokens per sequence (bytes with data.tokenizer = "bytes")."""
    accumulate: int | list[int] = 1
    """Micro-batches of batch_size sequences each rank sums per step: one number for
    every site, or one per site (`[2, 1]`: a site of GPUs twice as fast takes twice the
    micro-batches, so the sites finish a step together). The global batch is the sum
    over sites of accumulate x dp x batch_size, each site's gradient weighted by its
    tokens. Needs topology.pp = 1 and no parallel.offload."""
    balance_every: int = 0
    """Re-balance train.accumulate between the sites every this many steps, from each
    site's measured seconds per micro-batch, so the sites finish a step together; the
    global batch (its sum over sites of accumulate x dp) is held (deploy/batch/balance.py).
    0 keeps train.accumulate's split. Needs sync.mode = "step", topology.pp = 1, no
    parallel.offload, and room to move: give ranks 2 or more micro-batches."""
    batch_schedule: str = "fixed"
    """How the global batch changes over the job (deploy/batch/plan.py): "fixed" (the
    sum over sites of accumulate x dp micro-batches, every step), "ramp" (from
    batch_start micro-batches up to that sum, linearly over batch_ramp_steps, as
    Megatron's rampup_batch_size) or "noise" (from batch_start, grown toward the
    gradient noise scale of McCandlish et al. 2018 at each balance_every decision, up
    to that sum; needs two or more sites: each site's own mean gradient is the small
    batch of the estimate). The learning rate follows the batch by lr_scaling. Needs
    sync.mode = "step", topology.pp = 1 and no parallel.offload."""
    batch_start: int = 0
    """The global batch at step 0 of "ramp" and "noise", in micro-batches; 0 is one per
    replica of every site (the least there is)."""
    batch_ramp_steps: int = 0
    """"ramp": the steps over which the global batch grows to its full size."""
    lr: float = 3e-3
    """Peak learning rate (AdamW) at lr_reference_dp replicas; unset, the preset's."""
    warmup_steps: int = 5
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    lr_scaling: str = "sqrt"
    """Scale train.lr with the total data-parallel width W = sites x dp: "sqrt"
    (lr x sqrt(W / lr_reference_dp), the usual rule for Adam), "linear"
    (lr x W / lr_reference_dp) or "none"."""
    lr_reference_dp: int = 4
    """The data-parallel width (sites x dp) at which train.lr was tuned; unset, the preset's."""


@dataclass(kw_only=True, slots=True)
class ParallelSection:
    schedule: str = "1f1b"
    """Pipeline schedule when pp > 1: gpipe, 1f1b or interleaved_1f1b."""
    microbatches: int = 0
    """Micro-batches per step when pp > 1 (must divide train.batch_size); 0 = pp x stages per rank."""
    stages_per_rank: int = 0
    """Layer chunks per pipeline rank; 0 = 2 for interleaved_1f1b, else 1."""
    sequence_parallel: bool = False
    """With tp > 1, shard norms and the residual stream along the sequence (seq_len % tp == 0)."""
    activation_checkpoint: bool = False
    """Recompute each block in backward instead of keeping its activations."""
    compile: str = "auto"
    """torch.compile each transformer block: "auto" (on with CUDA, off on CPU, where
    it needs a C compiler and does not pay off), "true" or "false"."""
    mixed_precision: str = "auto"
    """bf16 compute with fp32 gradient reduction: "auto" (on with CUDA), "true" or "false"."""
    offload: bool = False
    """FSDP2 CPU offload: sharded parameters, gradients and AdamW state in host memory,
    the optimizer stepping on the CPU (for a model that does not fit the devices)."""


@dataclass(kw_only=True, slots=True)
class DataSection:
    source: str = "stdlib"
    """"stdlib" (the Python standard library's source files read as bytes), "path", or
    "prepared" (a folder `isthmus data prepare` wrote: token shards, memory-mapped;
    data.tokenizer must be the tokenizer.json it was prepared with, checked by sha256)."""
    path: str = ""
    """With source = "path": a text file, a folder of files, or a .bin/.npy token file.
    With source = "prepared": the prepared folder (docs/data.md)."""
    max_bytes: int = 32 * MIB
    """Cap on the corpus bytes loaded into memory."""
    val_fraction: float = 0.01
    """Share of the corpus held out for the validation loss, never trained on: blocks
    spread evenly over it (intra/data.py split_corpus; docs/data.md, "Held-out
    loss"). 0 = none (then no held-out loss is measured)."""
    tokenizer: str = "bytes"
    """How text becomes tokens: "bytes" (vocabulary 256), "bpe" (a byte-level BPE of
    vocab_size tokens trained on the training split, never on held-out text, cached in
    cache_dir), or the path of a tokenizer.json of Hugging Face `tokenizers` (e.g. from
    `isthmus tokenizer`; the model's vocabulary is its ids, padded to a multiple of 64).
    bpe and a file need `pip install 'isthmus[bpe]'`; .bin/.npy corpora are token ids
    already and take "bytes"."""
    vocab_size: int = 4096
    """With tokenizer = "bpe": tokens in the vocabulary (the 256 bytes included),
    257..65536; the model's vocabulary. Also the model's vocabulary for a pre-tokenized
    .bin/.npy corpus, whose ids must be below it."""
    tokenizer_sha256: str = ""
    """sha256 of the tokenizer's canonical JSON (`isthmus tokenizer` prints it), part of
    the job fingerprint: sites with different tokenizers are refused at join. Empty = the
    launcher fills it in from the tokenizer in use (training a bpe one first); set, a
    tokenizer whose hash differs is refused."""
    cache_dir: str = ""
    """Where trained tokenizers, tokenized corpora and the default corpus's bytes are kept
    between runs (keyed by a hash of the corpus and the settings); empty = $XDG_CACHE_HOME/isthmus, else
    ~/.cache/isthmus. May differ per site."""


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


@dataclass(kw_only=True, slots=True)
class FailoverSection:
    min_sites: int = 1
    """Never train with fewer live sites than this; below it the job stops."""
    failure_timeout_s: float = 10.0
    """A site not heard from (coordinator heartbeats) for this long is taken for dead:
    the others finish the step's rounds without it and carry on."""
    heartbeat_s: float = 1.0
    """Period of the heartbeats between coordinators."""
    quorum_wait_s: float = 300.0
    """How long a site cut off from a quorum waits for the link to heal (then it
    pulls the state and rejoins) before it stops with a message saying why."""
    witness: str = ""
    """host:port of the job's witness (`isthmus witness`, at a third place): a side
    holding exactly half the sites goes on only with its grant, so two sites survive
    the loss of either. Empty = none: an even split goes on on the side with site0."""


@dataclass(kw_only=True, slots=True)
class WanSection:
    distance_km: float = 1000.0
    """Emulated fiber distance between every pair of sites; ~4.9 us per km one way."""
    latency_ms: float = -1.0
    """One-way latency; negative derives it from distance_km."""
    bandwidth_mbit: float = 1000.0
    """Link bandwidth in Mbit/s, each direction."""
    per_flow_mbit: float = 0.0
    """Most Mbit/s one TCP connection gets, each direction (public clouds cap a flow:
    AWS at 5 Gbit/s); 0 = no cap. `isthmus local` emulates it, and the lanes open enough
    connections to fill the link (sync.connections = 0)."""
    queue_kib: int = 1024
    """Buffering beyond the bandwidth-delay product, KiB."""


EVAL_BATCH = 8
"""Windows per held-out batch (deploy/rank/evaluation.py). Not train.batch_size: the held-out
set would change with the layout, and runs of other per-rank batches would be measured
on other text."""


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


SECTION_TYPES = {
    "job": JobSection,
    "topology": TopologySection,
    "model": ModelSection,
    "parallel": ParallelSection,
    "train": TrainSection,
    "data": DataSection,
    "sync": SyncSection,
    "failover": FailoverSection,
    "wan": WanSection,
    "run": RunSection,
    "checkpoint": CheckpointSection,
    "cluster": ClusterSection,
    "security": SecuritySection,
}


def field_docs(section_type: type) -> dict[str, str]:
    """Docstrings written under each field, read from the source (for `isthmus config`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(section_type)))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = str(nxt.value.value)
    return docs
