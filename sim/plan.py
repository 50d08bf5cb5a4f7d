"""The planning model: step time and scaling efficiency at sizes no test machine holds.

A step of S sites, each a data-parallel replica holding 1/S of the global batch:

    compute_s  = F · tokens_per_site / (devices_per_site · peak_flops · mfu),  F = 6 · N by default
    wire_s     = 2(S−1)/S · gradient_bytes / codec_ratio · 8 / site_bandwidth_bps
    codec_s    = 2(S−1)/S · gradient_bytes / codec_bytes_per_s     (0 when not limiting)
    fill_1     = min(chunk_bytes, gradient_bytes / rounds) / codec_ratio · 8 / bw
    per_round  = fill_1 + rtt_s + round_overhead_s
    sync_s     = max(wire_s, codec_s) + max(1, rounds / window) · per_round
    tail_s     = max(wire_s, codec_s) / rounds + per_round      (the last round alone)
    exposed_s  = max(tail_s, sync_s − overlap · backward_s),  backward_s = backward_share · compute_s
                 (shared_cpu: max(rounds · round_overhead_s, the rest), no overlap)
    step_s     = compute_s + exposed_s + step_overhead_s

Scaling efficiency is measured the way NeMo reports it (weak scaling): S sites'
throughput against S times one site's, each site doing the same work, so
efficiency = (compute_s + step_overhead_s) / step_s. 2(S−1)/S × bytes is what each
site sends (and receives) in the owner-based all-reduce (docs/design.md), the ring
optimum. A round (one FSDP group) costs one RTT (contributions to owners, results
back) and one chunk of pipeline fill: a chunk's result cannot leave its owner before
its contributions arrived, so the link carries the last chunk twice in a row; a group
smaller than a chunk pays its whole size again. With `window` rounds in flight at
once, a round's latency and fill hide behind the other rounds' bytes, so the rounds
pay them window at a time; window 1 is rounds one after another.

`overlap` is the fraction of backward that cross-site traffic can hide behind: the
FSDP2 all-reduce hook starts each group's round as soon as its gradients exist, so
all but the last groups' traffic can run under the rest of backward -- with equal
groups, (rounds − 1) / rounds of it. The last round starts when backward ends, so
at least its own time, tail_s, is always exposed. This is a queue: groups arrive
evenly over backward and the link serves them in order; the wait after backward is
the larger of the last round alone and the work that did not fit under backward.
The exposed time is what the optimizer step waits for (`exposed_sync_s` in a run's
summary.json), the sync time what the rounds took (`sync_busy_s`).

`scaling_curve` gives the efficiency against the per-device batch: the sync does not
grow with the batch while backward does, so larger batches hide more of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

FLOPS_PER_PARAM_TOKEN = 6.0  # forward 2 + backward 4 multiply-adds per parameter per token
BACKWARD_SHARE = 2.0 / 3.0


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanInput:
    """One job and its link; every field in SI units unless named otherwise."""

    params: float  # trained parameters N
    active_params: float = 0.0
    """Parameters a token passes through, when fewer than ``params`` (a mixture of
    experts routes each token to ``top_k`` of its experts); 0 = all of them. Shown only:
    the compute comes from ``flops_per_token``, the bytes on the wire from ``params``
    (every expert's gradient crosses)."""
    flops_per_token: float = 0.0
    """Training FLOPs per token (forward + backward); 0 = 6 · params. Pass the model's
    own count (attention included) to read `mfu` the way a run reports it."""
    tokens_per_step: float  # global batch in tokens, over all sites
    sites: int = 2  # sites S, each a full data-parallel replica
    devices_per_site: int = 1  # accelerators (or processes) per site
    peak_flops: float = 989e12  # peak FLOP/s of one device (H100 SXM bf16 dense: 989e12)
    mfu: float = 0.4  # model FLOPs utilisation reached inside a site
    gradient_bytes_per_param: float = 4.0
    """Bytes per gradient element before the codec: 4 for fp32, 2 for bf16."""
    codec_ratio: float = 1.0
    """Raw gradient bytes / bytes on the wire (bf16 2, int8 4, zstd ~1.1 on fp32)."""
    bandwidth_bps: float = 1e9  # cross-site bandwidth of one site, bits per second, each direction
    rtt_s: float = 0.0098  # round-trip time between sites (1000 km of fiber: 9.8 ms)
    overlap: float = 0.0  # fraction of backward that cross-site traffic hides behind, 0..1
    backward_share: float = BACKWARD_SHARE
    """Share of compute_s spent in backward: 2/3 (4 of 6 FLOPs per parameter-token), 3/4
    with activation checkpointing (backward recomputes the forward: 6 of 8)."""
    codec_bytes_per_s: float = math.inf
    """Aggregate encode+decode throughput of a site's lanes, raw bytes/s."""
    rounds: int = 1  # cross-site rounds per step (FSDP groups)
    window: int = 1  # rounds in flight at once; 1 = one after another
    chunk_bytes: float = 1 << 20  # raw bytes per chunk of a round (sync.chunk_bytes)
    round_overhead_s: float = 0.0  # fixed cost of one round beyond its bytes (RPC set-up, Python)
    step_overhead_s: float = 0.0  # per-step cost that one site pays too (optimizer, logging)
    inner_steps: int = 1
    """Steps between cross-site rounds: 1 is per-step sync (``sync.mode = "step"``); H > 1
    is DiLoCo, whose round carries the fp32 outer gradient once per H steps, taken after
    a step, so nothing of it hides behind backward."""
    outer_delay: int = 0
    """DiLoCo: inner steps a round runs behind (``sync.outer_delay``), 0 <= d < H/P; the
    round is exposed only for what it needs beyond d steps of compute."""
    fragments: int = 1
    """Streaming DiLoCo: P fragments (``sync.fragments``) synced in turn, one round of
    1/P of the outer gradient every H/P steps; 1 = DiLoCo. Must divide H."""
    shared_cpu: bool = False
    """Compute runs on the same saturated CPU cores as the lanes (CPU-only training).
    Then, as measured on a 2-core machine, the rounds do not hide behind backward
    (overlap is ignored) and the lanes' CPU work (rounds x round_overhead_s) runs
    while they wait on the link: exposed = max(CPU work, link time)."""

    def __post_init__(self) -> None:
        positive = ("params", "tokens_per_step", "peak_flops", "mfu", "gradient_bytes_per_param")
        for name in positive + ("codec_ratio", "bandwidth_bps", "codec_bytes_per_s", "chunk_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        if not 0 < self.backward_share < 1:
            raise ValueError(f"backward_share must be in (0, 1), got {self.backward_share!r}")
        for name in ("sites", "devices_per_site", "rounds", "window", "inner_steps", "fragments"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"fragments must divide inner_steps={self.inner_steps}, got {self.fragments}"
            )
        period = self.inner_steps // self.fragments
        if not (isinstance(self.outer_delay, int) and 0 <= self.outer_delay < period):
            what = "inner_steps" if self.fragments == 1 else "inner_steps/fragments"
            raise ValueError(
                f"outer_delay must be an integer in [0, {what}={period}), got {self.outer_delay!r}"
            )
        for name in ("rtt_s", "round_overhead_s", "step_overhead_s", "flops_per_token"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """What the model predicts for one PlanInput."""

    inputs: PlanInput = field(repr=False)
    compute_s: float
    wire_s: float
    codec_s: float
    sync_s: float
    exposed_sync_s: float
    step_s: float
    tokens_per_s: float
    scaling_efficiency: float
    wire_bytes_per_site: float

    @property
    def one_site_tokens_per_s(self) -> float:
        """One site alone with the same per-device batch: S-site throughput / S at 100%."""
        p = self.inputs
        return p.tokens_per_step / p.sites / (self.compute_s + p.step_overhead_s)

    @property
    def overlap(self) -> float:
        """Share of the sync hidden behind backward, 1 - exposed / sync (1.0 for one site)."""
        return 1.0 - self.exposed_sync_s / self.sync_s if self.sync_s > 0 else 1.0

    @property
    def limit(self) -> str:
        """What bounds the cross-site time: "link", "cpu" (codecs) or "latency"."""
        p = self.inputs
        if p.sites == 1:
            return "none"
        latency = max(1.0, p.rounds / p.window) * (p.rtt_s + p.round_overhead_s)
        if latency > max(self.wire_s, self.codec_s):
            return "latency"
        return "cpu" if self.codec_s > self.wire_s else "link"


def predict(p: PlanInput) -> Plan:
    """Step time, cross-site time and scaling efficiency of one configuration."""
    tokens_per_site = p.tokens_per_step / p.sites
    flops_per_token = p.flops_per_token or FLOPS_PER_PARAM_TOKEN * p.params
    compute_s = flops_per_token * tokens_per_site / (p.devices_per_site * p.peak_flops * p.mfu)
    raw_bytes = 2 * (p.sites - 1) / p.sites * p.params * p.gradient_bytes_per_param
    wire_bytes = raw_bytes / p.codec_ratio
    if p.sites == 1:
        wire_s = codec_s = sync_s = tail_s = 0.0
    else:
        wire_s = wire_bytes * 8 / p.bandwidth_bps
        codec_s = raw_bytes / p.codec_bytes_per_s
        group_bytes = p.params * p.gradient_bytes_per_param / p.rounds
        fill_1 = min(p.chunk_bytes, group_bytes) / p.codec_ratio * 8 / p.bandwidth_bps
        per_round = fill_1 + p.rtt_s + p.round_overhead_s
        sync_s = max(wire_s, codec_s) + max(1.0, p.rounds / p.window) * per_round
        tail_s = max(wire_s, codec_s) / p.rounds + per_round
    if p.inner_steps > 1:
        # DiLoCo: one round per H steps, after a step (no backward to hide behind), or
        # behind the next `outer_delay` steps; spread over the H steps it serves.
        # Streaming: a round of 1/P of it (its share of the groups) every H/P steps.
        if p.sites > 1 and p.fragments > 1:
            wire_s, codec_s = wire_s / p.fragments, codec_s / p.fragments
            rounds = max(1.0, p.rounds / p.fragments)
            sync_s = max(wire_s, codec_s) + max(1.0, rounds / p.window) * per_round
        period = p.inner_steps // p.fragments
        behind = p.outer_delay * (compute_s + p.step_overhead_s)
        exposed = max(0.0, sync_s - behind) / period
        wire_s, codec_s, sync_s = (t / period for t in (wire_s, codec_s, sync_s))
        wire_bytes /= p.inner_steps
    elif p.shared_cpu and p.sites > 1:
        # Measured on a 2-core machine (benchmarks/plan_check.py): the lanes' CPU work
        # runs while they wait on the link, and nothing hides behind backward.
        exposed = max(p.rounds * p.round_overhead_s, sync_s - p.rounds * p.round_overhead_s)
    else:
        exposed = max(tail_s, sync_s - p.overlap * p.backward_share * compute_s)
    step_s = compute_s + exposed + p.step_overhead_s
    return Plan(
        inputs=p,
        compute_s=compute_s,
        wire_s=wire_s,
        codec_s=codec_s,
        sync_s=sync_s,
        exposed_sync_s=exposed,
        step_s=step_s,
        tokens_per_s=p.tokens_per_step / step_s,
        scaling_efficiency=(compute_s + p.step_overhead_s) / step_s,
        wire_bytes_per_site=wire_bytes,
    )


def bandwidth_for_efficiency(p: PlanInput, efficiency: float) -> float:
    """The cross-site bandwidth (bits/s per site) at which `p` reaches `efficiency`: 0.0
    for a single site (nothing crosses), math.inf when no bandwidth reaches the target
    (latency or codec CPU bound)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    if p.sites == 1:
        return 0.0

    def reaches(bandwidth_bps: float) -> bool:
        return predict(replace(p, bandwidth_bps=bandwidth_bps)).scaling_efficiency >= efficiency

    # Efficiency only grows with bandwidth (wire time and pipeline fill shrink, the rest
    # stays), so bisect; where even a link of 1e18 bit/s falls short, latency or the
    # codecs' CPU bound the step.
    low, high = 1.0, 1e18
    if not reaches(high):
        return math.inf
    while high / low > 1 + 1e-12:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if reaches(middle) else (middle, high)
    return high


def scaling_curve(p: PlanInput, batches: list[int], seq_len: int) -> list[Plan]:
    """Predictions of `p` at each per-device batch (sequences of `seq_len` tokens): a site
    trains batch x seq_len x devices_per_site tokens a step."""
    if seq_len < 1 or any(b < 1 for b in batches):
        raise ValueError(f"batches and seq_len must be >= 1, got {batches} x {seq_len}")
    return [
        predict(replace(p, tokens_per_step=b * seq_len * p.devices_per_site * p.sites))
        for b in batches
    ]


def nemotron_340b(*, sites: int = 2, devices_per_site: int = 1536) -> PlanInput:
    """Nemotron-4 340B as its technical report trained it (H100s at 41% MFU), split over
    `sites`, bf16 gradients across them. GPUs per site are an assumption: NeMo's
    multi-datacenter post says "thousands of GPUs" over two sites ~1000 km apart."""
    return PlanInput(
        params=340e9,
        tokens_per_step=2304 * 4096,
        sites=sites,
        devices_per_site=devices_per_site,
        peak_flops=989e12,
        mfu=0.41,
        gradient_bytes_per_param=2.0,
        rtt_s=2 * 1000 * 4.9e-6,
        rounds=96,  # one FSDP group per transformer layer
        chunk_bytes=4 << 20,
        overlap=0.9,
        bandwidth_bps=400e9,
    )
