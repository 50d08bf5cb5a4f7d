"""One rank's cross-site plumbing: its lane, its place in the membership, its state offers.

`CrossSite.start` opens the rank's lane, registers it with the site's coordinator,
waits for the membership and builds the `LaneGradientSync` the trainer calls. When
the site joins a job already under way (it was restarted, or left out while cut
off), `catch_up` pulls the training state after the job's last committed step from
the rank at the same mesh coordinate of a live site and loads it; `offer_state`
is the other side, after a step that admitted a site.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from isthmus.deploy.batch_plan import BatchPlan
from isthmus.deploy.config import JobConfig
from isthmus.deploy.rank_extras import extra_state, load_extra_state
from isthmus.inter.control.coordinator_client import (
    CoordinatorClient,
    Decision,
    Membership,
    SiteInfo,
)
from isthmus.inter.data.allreduce import CrossSiteAllReduce
from isthmus.inter.data.codec import make_codec
from isthmus.inter.data.gradient_sync import LaneGradientSync
from isthmus.inter.data.lane import RESERVED_THREADS, LaneServer
from isthmus.inter.data.lane_peer import LanePeer
from isthmus.inter.data.mailbox import MAX_STEPS_AHEAD
from isthmus.inter.data.membership import SiteMembership
from isthmus.inter.data.shard_map import GroupShape, ShardPosition
from isthmus.inter.data.state_transfer import pull_state
from isthmus.inter.security import SiteSecurity
from isthmus.intra.outer import OuterOptimizer
from isthmus.intra.parallel import group_parameters, sharded_rows
from isthmus.intra.reshard import reshard_state, source_shards
from isthmus.intra.state import load_rank_state, rank_state
from isthmus.intra.train import Trainer

log = logging.getLogger("isthmus.rank")


@dataclass
class CrossSite:
    """The cross-site side of one rank (see the module docstring)."""

    site: str
    rank: int
    config: JobConfig
    proxies: dict[str, str]
    security: SiteSecurity | None
    lane: LaneServer
    joined: Membership
    """The membership this rank first learned (a running job's names the state to pull)."""
    coordinator: CoordinatorClient
    sync: LaneGradientSync = field(init=False)
    outer: OuterOptimizer | None = None
    """DiLoCo's outer optimizer, whose state travels with the rank's (set by the caller)."""
    plan: BatchPlan | None = None
    """The global batch's size and split, which travel with the rank's state (set by the caller)."""

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
    ) -> CrossSite:
        """Opens the lane, joins the job and builds the gradient sync."""
        codec = make_codec(config.sync.codec)
        cluster = config.cluster
        sites = config.site_names
        lane = LaneServer(
            site_index=sites.index(site),
            num_sites=len(sites),
            codec=codec.name,
            chunk_bytes=config.chunk_bytes,
            host=cluster.lane_host,
            port=cluster.lane_port_base + rank if cluster.lane_port_base else 0,
            # A peer learns this lane's address only from membership generation 1, and
            # may start its first round before this rank has heard of the membership
            # itself: be at generation 1 from the start (chunks of a later generation
            # are held until the rank catches up).
            generation=1,
            security=security,
            mailbox_bytes=mailbox_budget(config),
            # Rounds are inner_steps apart in DiLoCo: the window counts rounds, not steps.
            steps_ahead=MAX_STEPS_AHEAD
            * (config.sync.inner_steps if config.sync.mode != "step" else 1),
            # A stream per connection per round in flight from every peer, twice over
            # (a round's streams may outlive it briefly), and the reserved threads.
            max_workers=RESERVED_THREADS
            + max(
                24, 2 * (len(sites) - 1) * config.lane_connections * config.sync.rounds_in_flight
            ),
        )
        lane.rank = rank
        port = lane.address.rsplit(":", 1)[1]
        # One cluster.advertise_host cannot name every host of a site on several: the
        # launcher of a rank on another host names that host's address in the environment.
        host = os.environ.get("ISTHMUS_ADVERTISE_HOST") or cluster.advertise_host
        advertised = f"{host or cluster.lane_host}:{port}"
        client = CoordinatorClient.connect(coordinator, security)
        joined = _join(client, site, rank, world_size, advertised, config)
        self = cls(site, rank, config, proxies, security, lane, joined, client)
        allreduce = CrossSiteAllReduce(
            site_index=0,
            num_sites=1,
            server=lane,
            peers={},
            codec=codec,
            chunk_bytes=config.chunk_bytes,
            timeout_s=config.sync.timeout_s,
            generation=joined.generation,
            workers=config.sync.workers or None,
        )
        membership = SiteMembership(
            client=client,
            site=site,
            rank=rank,
            allreduce=allreduce,
            make_peer=self._make_peer,
            sites=list(joined.sites),
            generation=joined.generation,
            decision_timeout_s=config.sync.timeout_s + config.failover.quorum_wait_s,
        )
        self.sync = LaneGradientSync(
            allreduce, membership=membership, rounds_in_flight=config.sync.rounds_in_flight
        )
        return self

    def _make_peer(self, info: SiteInfo, rank: int | None = None) -> LanePeer:
        return LanePeer(
            info.lane_addresses[self.rank if rank is None else rank],
            proxy=self.proxies.get(info.name),
            connections=self.config.lane_connections,
            chunk_bytes=self.config.chunk_bytes,
            security=self.security,
            transport=self.config.sync.transport,
        )

    def catch_up(self, trainer: Trainer) -> int | None:
        """For a site joining a running job: pull and load the live state.

        Returns:
            The step to continue from, or None when the job starts here (step 0).
        """
        joined = self.joined
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
        self.sync.membership.configure(decision.generation, list(decision.sites))
        return self._pull(
            trainer,
            decision.generation,
            list(decision.sites),
            decision.state_source,
            decision.state_step,
        )

    def _pull(
        self,
        trainer: Trainer,
        generation: int,
        sites: list[SiteInfo],
        source: str,
        state_step: int,
    ) -> int:
        info = next((s for s in sites if s.name == source), None)
        if info is None:
            raise RuntimeError(
                f"state source {source!r} is not a member of generation {generation}"
            )
        own, theirs = self.config.ranks_of(self.site), len(info.lane_addresses)
        t0 = time.perf_counter()
        if theirs == own:
            state = self._pull_rank(info, generation, state_step, self.rank)
            next_step, extra = load_rank_state(trainer, state)
            load_extra_state(extra, self.sync, self.outer, self.plan)
        else:
            # A site of another size: its ranks hold other rows; cut ours from theirs.
            state = self._pull_resharded(trainer, info, generation, state_step)
            next_step, extra = load_rank_state(trainer, state)
            # The codec residuals belong to the source's lanes, cut into other pieces.
            load_extra_state(extra, None, self.outer, self.plan)
        size = sum(t.numel() * t.element_size() for t in state.values())
        log.warning(
            "[%s/%d] pulled the state after step %d from %s (%.1f MB in %.2fs); "
            "continuing at step %d",
            self.site,
            self.rank,
            state_step,
            source,
            size / 1e6,
            time.perf_counter() - t0,
            next_step,
        )
        return next_step

    def _pull_rank(
        self, info: SiteInfo, generation: int, state_step: int, rank: int
    ) -> dict[str, torch.Tensor]:
        """The state after ``state_step`` that ``rank`` of site ``info`` offers."""
        peer = self._make_peer(info, rank)
        try:
            return pull_state(
                peer.stub,
                generation=generation,
                step=state_step,
                rank=rank,
                timeout_s=self.config.sync.timeout_s,
            )
        finally:
            peer.close()

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
            j: self._pull_rank(info, generation, state_step, position.rank_of(ranks, j))
            for j in source_shards(trainer, width)
        }
        groups = [[name for name, _ in g] for g in self.outer.groups] if self.outer else []
        return reshard_state(trainer, sources, width, groups)

    def offer_state(self, trainer: Trainer, decision: Decision, next_step: int) -> None:
        """After a step whose commit admitted a site and named this one as the source
        of its state (``StepOutcome.offer_state``): offer the state, for ``PullState``."""
        state = rank_state(trainer, next_step, extra=extra_state(self.sync, self.outer, self.plan))
        self.lane.offers.offer(decision.generation, decision.state_step, state)

    def close(self) -> None:
        self.sync.close()
        self.lane.stop(grace=5.0)
        self.coordinator.close()


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
    """Bytes a lane's mailbox may hold: two steps of its traffic at fp32, the widest
    codec (per step a lane receives at most its shard's contributions and its shard's
    results), plus 16 chunks of slack."""
    shard = 4 * config.resolved_model().num_params // min(config.site_ranks)
    return 2 * 2 * shard + 16 * config.chunk_bytes


def _join(
    client: CoordinatorClient,
    site: str,
    rank: int,
    world_size: int,
    lane_address: str,
    config: JobConfig,
) -> Membership:
    """Register this rank's lane and wait for the job's membership."""
    client.register_rank(
        site=site,
        rank=rank,
        world_size=world_size,
        lane_address=lane_address,
        fingerprint=config.fingerprint(),
        timeout_s=10,
    )
    return client.wait_membership(config.sync.timeout_s)
