"""One rank's cross-site side: its sync (opened with inter/data's one entry point), and
the training state it pulls or offers.

`CrossSite.start` turns the job's config into the rank's sync settings and opens the
sync (`open_rank_sync`: the lane, the join, the membership and the `LaneGradientSync`
the trainer calls). When the site joins a job already under way (it was restarted,
or left out while cut off), `catch_up` pulls the training state after the job's last
committed step from the rank at the same mesh coordinate of a live site and loads it;
`offer_state` is the other side, after a step that admitted a site."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from isthmus.deploy.batch.plan import BatchPlan
from isthmus.deploy.config.job import JobConfig
from isthmus.deploy.rank.contract import AGENT_ENV
from isthmus.deploy.rank.extras import extra_state, load_extra_state
from isthmus.inter.control.coordinator_client import CoordinatorClient, Decision, SiteInfo
from isthmus.inter.data import (
    ExpectedState,
    Generation,
    GroupShape,
    LaneGradientSync,
    RankSync,
    RankSyncSettings,
    ShardPosition,
    open_rank_sync,
)
from isthmus.inter.security import SiteSecurity
from isthmus.intra.outer import OuterOptimizer
from isthmus.intra.parallel import group_parameters, sharded_rows
from isthmus.intra.reshard import chunk_rows, reshard_state, source_shards
from isthmus.intra.state import (
    EXTRA,
    expected_layout,
    load_rank_state,
    named_parameters,
    rank_state,
)
from isthmus.intra.train import Trainer

log = logging.getLogger("isthmus.rank")

EXTRA_COPIES = 4
"""Copies of the model shard, at fp32 or wider, that a state's ``extra/`` entries may
take: the outer optimizer's anchor and momentum, and the codec's error-feedback
residuals of the rank's contributions and of the results it reduced, each at most the
source's shard as padded for its reduce-scatter."""
EXTRA_SLACK = 1 << 20
"""Bytes beyond those for the batch split and the noise scale's few scalars."""


@dataclass
class CrossSite:
    """The cross-site side of one rank (see the module docstring)."""

    site: str
    rank: int
    config: JobConfig
    link: RankSync  # the rank's open cross-site sync: lane, membership, gradient sync
    coordinator: CoordinatorClient
    # Whose state travels with the rank's (set by the caller): DiLoCo's outer optimizer,
    # the global batch's size and split.
    outer: OuterOptimizer | None = None
    plan: BatchPlan | None = None
    pulled: tuple[float, int] | None = None  # the last state pull's seconds and bytes, unread

    @property
    def sync(self) -> LaneGradientSync:
        """What the trainer calls: averages each step's gradients over the live sites."""
        return self.link.sync

    @classmethod
    def start(
        cls,
        *,
        site: str,
        rank: int,
        world_size: int,
        coordinator: str,
        proxies: dict[str, str],
        config: JobConfig,
        security: SiteSecurity | None,
        host_agent: str = "",
    ) -> CrossSite:
        """Opens the rank's cross-site sync: the lane, the join, the gradient sync (its
        votes and watches through ``host_agent`` when there is one: checked to be this
        user's, and waited for as long as the join may take, inter/control/agent_socket.py)."""
        if not host_agent:
            log.info("no host agent (%s unset): votes and watches go to the coordinator", AGENT_ENV)
        client = CoordinatorClient.connect(
            coordinator, security, agent=host_agent, agent_wait_s=config.sync.timeout_s
        )
        try:
            link = open_rank_sync(
                sync_settings(config, site, rank, world_size, proxies, security), client
            )
        except BaseException:
            client.close()
            raise
        return cls(site, rank, config, link, client)

    def catch_up(self, trainer: Trainer) -> int | None:
        """For a site joining a running job: pull and load the live state; the step to
        continue from, or None when the job starts here (step 0)."""
        joined = self.link.joined
        if not joined.state_source or joined.state_source == self.site:
            return None
        return self._pull(
            trainer,
            joined.generation,
            list(joined.sites),
            joined.state_source,
            joined.start_step - 1,
        )

    def rejoin(self, trainer: Trainer, decision: Decision) -> int:
        """The job went on without this site: move to its generation and pull its state."""
        self.link.membership.adopt(Generation.of(decision))
        return self._pull(
            trainer,
            decision.generation,
            list(decision.sites),
            decision.state_source,
            decision.state_step,
        )

    def _pull(
        self, trainer: Trainer, generation: int, sites: list[SiteInfo], source: str, state_step: int
    ) -> int:
        info = next((s for s in sites if s.name == source), None)
        if info is None:
            raise RuntimeError(
                f"state source {source!r} is not a member of generation {generation}"
            )
        own, theirs = self.config.ranks_of(self.site), len(info.lane_addresses)
        t0 = time.perf_counter()
        if theirs == own:
            state = self._pull_rank(info, generation, state_step, self.rank, expected_pull(trainer))
            next_step, extra = load_rank_state(trainer, state)
            load_extra_state(extra, self.sync, self.outer, self.plan)
        else:
            # A site of another size: its ranks hold other rows; cut ours from theirs.
            state = self._pull_resharded(trainer, info, generation, state_step)
            next_step, extra = load_rank_state(trainer, state)
            # The codec residuals belong to the source's lanes, cut into other pieces.
            load_extra_state(extra, None, self.outer, self.plan)
        size = sum(t.numel() * t.element_size() for t in state.values())
        self.pulled = (time.perf_counter() - t0, size)
        log.warning(
            "[%s/%d] pulled the state after step %d from %s (%.1f MB in %.2fs); "
            "continuing at step %d",
            self.site,
            self.rank,
            state_step,
            source,
            size / 1e6,
            self.pulled[0],
            next_step,
        )
        return next_step

    def _pull_rank(
        self, info: SiteInfo, generation: int, state_step: int, rank: int, expected: ExpectedState
    ) -> dict[str, torch.Tensor]:
        """The state after ``state_step`` that ``rank`` of site ``info`` offers; a piece
        not ``expected`` is refused before it is allocated, and the trainer is unchanged."""
        return self.link.pull_state(
            info, generation=generation, step=state_step, rank=rank, expected=expected
        )

    def _pull_resharded(
        self, trainer: Trainer, info: SiteInfo, generation: int, state_step: int
    ) -> dict[str, torch.Tensor]:
        """This rank's state cut from the ranks of a site of another size whose rows
        overlap its own (intra/reshard.py)."""
        position = self.sync.position
        if position is None:
            raise RuntimeError("sites of different sizes, but no shard layout was set")
        ranks = len(info.lane_addresses)
        width = position.width(ranks)
        sources = {
            j: self._pull_rank(
                info,
                generation,
                state_step,
                position.rank_of(ranks, j),
                expected_pull(trainer, source_width=width, shard=j),
            )
            for j in source_shards(trainer, width)
        }
        groups = [[name for name, _ in g] for g in self.outer.groups] if self.outer else []
        return reshard_state(trainer, sources, width, groups)

    def offer_state(self, trainer: Trainer, decision: Decision, next_step: int) -> None:
        """After a step whose commit admitted a site and named this one as the source
        of its state (``StepOutcome.offer_state``): offer the state, for ``PullState``."""
        state = rank_state(trainer, next_step, extra=extra_state(self.sync, self.outer, self.plan))
        self.link.offer_state(
            decision.generation,
            decision.state_step,
            state,
            sites=list(decision.sites),
            admitted=list(decision.admitted),
        )

    def close(self) -> None:
        self.link.close()
        self.coordinator.close()


def expected_pull(
    trainer: Trainer, *, source_width: int | None = None, shard: int = 0
) -> ExpectedState:
    """What this rank may pull from its peer at a live site, read off its own model and
    optimizer: the source does not set its memory (issue 63). ``source_width``: the
    source site's shard ranks when its size differs (its rank holds shard ``shard`` of
    each parameter's rows). ``extra/`` entries stay open, within :data:`EXTRA_COPIES`."""
    layout = expected_layout(trainer)
    rows = {key: row for part in trainer.model_parts for key, row in sharded_rows(part).items()}
    shard_bytes = 0  # of the source's shard, padded, at fp32 or wider
    for fqn, p in named_parameters(trainer):
        shape, dtype = layout[f"model/{fqn}"]
        padded = p.numel()  # not sharded by FSDP: every rank holds it whole
        if id(p) in rows:
            n, row_elems, _, own_width = rows[id(p)]
            padded = -(-n // (source_width or own_width)) * row_elems
            if source_width is not None:
                lo, hi = chunk_rows(n, source_width, shard)
                shape = (hi - lo, *shape[1:])
        for name in (f"model/{fqn}", f"optim/{fqn}/exp_avg", f"optim/{fqn}/exp_avg_sq"):
            layout[name] = (shape, dtype)
        shard_bytes += padded * max(4, p.element_size())
    return ExpectedState(
        tensors=layout, open_prefix=EXTRA, open_bytes=EXTRA_COPIES * shard_bytes + EXTRA_SLACK
    )


def shard_layout(
    config: JobConfig, trainer: Trainer, outer: OuterOptimizer | None
) -> tuple[ShardPosition, dict[int, GroupShape]]:
    """This rank's position in its site and the tensors of each group it syncs, for
    sites of different sizes (``LaneGradientSync.set_layout``): per-step sync hands
    FSDP2's padded reduce-scatter outputs, offload and the outer modes packed shards."""
    rows: dict[int, tuple[int, int, int, int]] = {}
    params: dict[str, torch.nn.Parameter] = {}
    for part in trainer.model_parts:
        rows |= sharded_rows(part)
        params |= dict(part.named_parameters())
    shards = {(index, width) for _, _, index, width in rows.values()}
    if len(shards) != 1:
        raise ValueError(f"parameters sharded over several meshes {sorted(shards)}")
    ((shard_index, width),) = shards
    pp_i, _, _, tp_i = trainer.coordinate
    position = ShardPosition(
        pp=trainer.pp, tp=trainer.tp, pp_index=pp_i, tp_index=tp_i, shard_index=shard_index
    )
    if width != trainer.dp * trainer.cp or position.width(trainer.mesh.size()) != width:
        raise ValueError(f"FSDP shards over {width} ranks, not dp x cp of the site")

    def shape(group: list[torch.nn.Parameter], padded: bool) -> GroupShape:
        return GroupShape(
            rows=tuple(rows[id(p)][0] for p in group),
            row_elems=tuple(rows[id(p)][1] for p in group),
            padded=padded,
        )

    if outer is not None:
        groups = [[params[name] for name, _ in g] for g in outer.groups]
        return position, {i: shape(g, padded=False) for i, g in enumerate(groups)}
    padded = not config.parallel.offload  # offload syncs the host shards, packed
    return position, {i: shape(group_parameters(g), padded) for i, g in enumerate(trainer.groups)}


def mailbox_budget(config: JobConfig) -> int:
    """Bytes a lane's mailbox may hold: two steps of its traffic (its shard's contributions
    and results) at fp32, the widest codec, plus 16 chunks of slack."""
    shard = 4 * config.resolved_model().num_params // min(config.site_ranks)
    return 2 * 2 * shard + 16 * config.chunk_bytes


def sync_settings(
    config: JobConfig,
    site: str,
    rank: int,
    world_size: int,
    proxies: dict[str, str],
    security: SiteSecurity | None,
) -> RankSyncSettings:
    """The rank's cross-site sync settings, from the job's config."""
    cluster, sync = config.cluster, config.sync
    return RankSyncSettings(
        site=site,
        rank=rank,
        world_size=world_size,
        job_sites=tuple(config.site_names),
        fingerprint=config.fingerprint(),
        codec=sync.codec,
        chunk_bytes=config.chunk_bytes,
        timeout_s=sync.timeout_s,
        decision_timeout_s=sync.timeout_s + config.failover.quorum_wait_s,
        rounds_in_flight=sync.rounds_in_flight,
        workers=sync.workers or None,
        # Rounds are inner_steps apart in DiLoCo: the lane's window counts rounds.
        steps_between_rounds=sync.inner_steps if sync.mode != "step" else 1,
        lane_host=cluster.lane_host,
        lane_port=cluster.lane_port_base + rank if cluster.lane_port_base else 0,
        # One cluster.advertise_host cannot name every host of a site on several: the
        # launcher of a rank on another host names that host's address in the environment.
        advertise_host=os.environ.get("ISTHMUS_ADVERTISE_HOST") or cluster.advertise_host,
        lane_connections=config.lane_connections,
        transport=sync.transport,
        mailbox_bytes=mailbox_budget(config),
        proxies=proxies,
        security=security,
    )
