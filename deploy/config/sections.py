"""The sections of a job config, each a typed dataclass whose fields are documented
where they are defined (`isthmus config` prints these docs) and whose ``check`` refuses
its own bad values; this module holds what a site trains, run_sections.py how the sites
run and reach each other. Loading and precedence live in job.py, the checks that span
sections in validation.py."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

from isthmus.intra.corpus.tokenizer import MAX_VOCAB, MIN_BPE_VOCAB, file_facts, require_tokenizers
from isthmus.intra.layout import ParallelConfig
from isthmus.intra.user_files import ConfigError

KIB = 1024
MIB = 1024 * KIB
SHA256_RULE = "empty or 64 lowercase hex digits"


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def at_least(section: str, values: object, **lows: float) -> None:
    """Refuse a key of ``values`` below its bound, naming SECTION.KEY."""
    for key, low in lows.items():
        value = getattr(values, key)
        require(value >= low, f"{section}.{key} must be >= {low}, got {value}")


def positive(section: str, values: object, *keys: str) -> None:
    """Refuse a key of ``values`` at or below 0, naming SECTION.KEY."""
    for key in keys:
        value = getattr(values, key)
        require(value > 0, f"{section}.{key} must be > 0, got {value}")


def one_of(section: str, values: object, key: str, *choices: str) -> None:
    """Refuse a key of ``values`` that is none of ``choices``, naming them."""
    value, words = getattr(values, key), f"{', '.join(choices[:-1])} or {choices[-1]}"
    require(value in choices, f"{section}.{key} must be {words}, got {value!r}")


def is_sha256(text: str) -> bool:
    """Empty, or a sha256 as 64 lowercase hex digits."""
    return not text or (len(text) == 64 and all(c in "0123456789abcdef" for c in text))


@dataclass(kw_only=True, slots=True)
class JobSection:
    name: str = "isthmus"
    """Job name, shown in logs and part of the job fingerprint."""
    seed: int = 0
    """Seed for model initialisation and data sampling; identical on every site."""
    steps: int = 20
    """Optimizer steps to run."""

    def check(self) -> None:
        at_least("job", self, steps=1)


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

    @property
    def site_names(self) -> list[str]:
        return [f"site{i}" for i in range(self.sites)]

    @property
    def site_ranks(self) -> list[int]:
        """Each site's rank count, by site index (one number for all, or one per site)."""
        ranks = self.ranks_per_site
        return list(ranks) if isinstance(ranks, list) else [ranks] * self.sites

    def site_dp(self) -> list[int]:
        return [n // (self.pp * self.cp * self.tp) for n in self.site_ranks]

    def check(self) -> None:
        require(1 <= self.sites <= 64, f"topology.sites must be in 1..64, got {self.sites}")
        sizes = self.site_ranks
        require(
            not isinstance(self.ranks_per_site, list) or len(sizes) == self.sites,
            f"topology.ranks_per_site names {len(sizes)} site sizes {sizes} for "
            f"topology.sites={self.sites}: give one per site, or one number for all",
        )
        require(
            all(n >= 1 for n in sizes),
            f"topology.ranks_per_site must be >= 1, got {self.ranks_per_site}",
        )
        pp, cp, tp = self.pp, self.cp, self.tp
        require(
            pp >= 1 and tp >= 1 and cp >= 1,
            f"topology.pp, topology.cp and topology.tp must be >= 1, got {pp}, {cp}, {tp}",
        )
        for n in sizes:
            require(
                n % (pp * cp * tp) == 0,
                f"layout does not divide the ranks: topology.ranks_per_site={n} "
                f"is not divisible by pp*cp*tp={pp}*{cp}*{tp}={pp * cp * tp} "
                "(sites may differ in dp only: pp, cp and tp are the same at every site)",
            )
        require(
            len(set(sizes)) == 1 or self.ep == 1,
            f"topology.ep={self.ep} needs sites of one size, got topology.ranks_per_site={sizes}: "
            "expert-parallel sites of different sizes are not supported yet",
        )
        one_of("topology", self, "device", "auto", "cpu", "cuda")


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

    def site_accumulate(self, sites: int) -> list[int]:
        m = self.accumulate
        return list(m) if isinstance(m, list) else [m] * sites

    def check(self) -> None:
        """The train.* values alone (deploy/config/validation.py checks them against
        the sites, the pipeline and the sync mode)."""
        at_least("train", self, batch_size=1)
        require(
            min(self.site_accumulate(1)) >= 1,
            f"train.accumulate must be >= 1, got {self.accumulate}",
        )
        at_least("train", self, balance_every=0)
        one_of("train", self, "batch_schedule", "fixed", "ramp", "noise")
        at_least("train", self, seq_len=2)
        positive("train", self, "lr")
        at_least("train", self, warmup_steps=0, grad_clip=0)
        one_of("train", self, "lr_scaling", "sqrt", "linear", "none")
        at_least("train", self, lr_reference_dp=1)


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

    def check(self) -> None:
        """The auto/true/false switches (validation.py checks the layout)."""
        for key in ("compile", "mixed_precision"):
            one_of("parallel", self, key, "auto", "true", "false")

    def config(self, *, cuda: bool, expert_parallel: int) -> ParallelConfig:
        def switch(value: str) -> bool:  # "auto" is on with CUDA
            return cuda if value == "auto" else value == "true"

        return ParallelConfig(
            schedule=self.schedule,
            microbatches=self.microbatches or None,
            stages_per_rank=self.stages_per_rank or None,
            sequence_parallel=self.sequence_parallel,
            activation_checkpoint=self.activation_checkpoint,
            # Compiled blocks reach ~49% MFU at the 1b preset on an H100 against ~32%
            # eager (benchmarks/site_step.py), so CUDA compiles unless told not to.
            compile=switch(self.compile),
            mixed_precision=switch(self.mixed_precision),
            offload=self.offload,
            expert_parallel=expert_parallel,
        )


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
    spread evenly over it (intra/corpus/batches.py split_corpus; docs/data.md, "Held-out
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

    @property
    def pretokenized(self) -> bool:
        """A .bin/.npy corpus: token ids already."""
        return self.source == "path" and Path(self.path).suffix in (".bin", ".npy")

    def check(self) -> None:
        """data.* but the tokenizer's keys (``check_tokenizer``, run first)."""
        one_of("data", self, "source", "stdlib", "path", "prepared")
        require(
            self.source == "stdlib" or bool(self.path),
            f"data.source = {self.source!r} needs data.path",
        )
        require(
            self.source != "prepared" or self.tokenizer not in ("bytes", "bpe"),
            'data.source = "prepared" needs data.tokenizer = the tokenizer.json it was prepared '
            f"with (e.g. {Path(self.path) / 'tokenizer.json'})",
        )
        at_least("data", self, max_bytes=1024)
        require(
            0 <= self.val_fraction <= 0.5,
            f"data.val_fraction must be in [0, 0.5], got {self.val_fraction}",
        )

    def check_tokenizer(self) -> None:
        """data.tokenizer and the keys that go with it."""
        require(
            MIN_BPE_VOCAB <= self.vocab_size <= MAX_VOCAB,
            f"data.vocab_size must be in {MIN_BPE_VOCAB}..{MAX_VOCAB} (ids fit uint16), got "
            f"{self.vocab_size}",
        )
        sha, kind = self.tokenizer_sha256, self.tokenizer
        require(is_sha256(sha), f"data.tokenizer_sha256 must be {SHA256_RULE}, got {sha!r}")
        if kind == "bytes":
            require(
                not sha,
                'data.tokenizer_sha256 pins a BPE tokenizer; data.tokenizer = "bytes" has none '
                "(leave it empty)",
            )
            return
        require(
            not self.pretokenized,
            f"data.tokenizer = {kind!r} is for text, and data.path {self.path!r} holds token "
            'ids already (.bin/.npy): leave data.tokenizer = "bytes"',
        )
        if kind != "bpe":
            require(
                Path(kind).is_file(),
                f'data.tokenizer must be "bytes", "bpe" or the path of a tokenizer.json; '
                f"{kind!r} is neither (no such file)",
            )
            try:
                file_facts(kind)
            except (ValueError, OSError) as exc:
                raise ConfigError(f"data.tokenizer: {exc}") from None
        if self.source == "prepared":
            return  # token ids already: the file is only hashed, never run
        try:
            require_tokenizers()
        except ValueError as exc:
            raise ConfigError(f"data.tokenizer = {kind!r}: {exc}") from None


EVAL_BATCH = 8
"""Windows per held-out batch (deploy/rank/evaluation.py). Not train.batch_size: the held-out
set would change with the layout, and runs of other per-rank batches would be measured
on other text."""


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
