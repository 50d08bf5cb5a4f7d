"""The lane's calls besides the chunk stream and the hand-offs: a member site giving a
round up (``AbortRound``) and a joining rank pulling the training state (``PullState``).

``PullState`` streams the state this rank offers to a rank of a site the commit
admitted, once, and to no one else (issue 63: the state offered at a rejoin stayed
served to any token holder). A pull waits for nothing: a state not offered yet is
answered UNAVAILABLE, and the joining rank asks again. Before a byte goes out the pull
is checked with the asking rank's own lane (``ConfirmPull``); the asking site's share
of the slots (:data:`PULL_STATE_SHARE`) is held only for that check and the stream.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.data.lane.gate import LaneGate
from isthmus.inter.data.lane.handoff import budget
from isthmus.inter.data.state.transfer import pieces
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.bounds import WaitSlots
    from isthmus.inter.data.lane.mailbox import Mailbox
    from isthmus.inter.data.state.offers import Offer, StateOffers

__all__ = ["PULL_STATE_SHARE", "LaneRequests"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaneRequests:
    """``AbortRound`` and ``PullState`` of one lane, handed the checks of its callers,
    the mailbox (where a round given up is noted), the state this rank offers, the
    ``PullState`` slots and the lane's rank in its site (set once the rank knows it)."""

    gate: LaneGate
    mailbox: Mailbox
    offers: StateOffers
    pulls: WaitSlots
    rank: Callable[[], int]

    def abort_round(
        self, request: lane_pb2.AbortRoundRequest, context: grpc.ServicerContext
    ) -> lane_pb2.AbortRoundResponse:
        """Notes that a member site gave up a round of this generation: this rank's
        part of it fails at once (``RoundPipeline``) instead of at its deadline."""
        self.gate.refuse_unless_sender(context, request.from_site, "AbortRound")
        members = self.gate.in_generation(context, request.generation)
        self.gate.refuse_unless_peer(context, request.from_site)
        refused = self.mailbox.note_abort(
            request.step, request.group, request.from_site, request.reason
        )
        if refused is not None:
            self.gate.refusals.note(
                context.peer(),
                f"AbortRound of step {request.step} group {request.group}: {refused}",
            )
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {members.site_index} did not note the abort: {refused}",
            )
        return lane_pb2.AbortRoundResponse()

    def pull_state(
        self, request: lane_pb2.PullStateRequest, context: grpc.ServicerContext
    ) -> Iterator[lane_pb2.StatePiece]:
        """Streams this rank's training state after ``request.step`` to the rank of an
        admitted site that asked for it, once (see the module docstring)."""
        gate, members, me = self.gate, self.gate.members(), self.rank()
        if request.generation > members.generation:
            # Admitted by a round voted ahead: this rank moves there when it lands it.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"site {members.site_index} is in generation {members.generation}, not yet "
                f"{request.generation}: ask again",
            )
        site_index = gate.in_generation(context, request.generation).site_index
        if request.rank != me:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank {request.rank} asked the lane of rank {me}: pull from your "
                "own mesh coordinate",
            )
        gate.refuse_unless_nonce(context, request.nonce)
        offers, where = self.offers, f"site {site_index} rank {me}"
        offer = self._offer(request, context, where)
        site, rank = request.site, request.from_rank
        what = f"PullState in {site[:64]!r}'s name (rank {rank})"
        refused = offer.admitted.refusal(site, rank)
        if refused is not None:
            gate.refusals.note(context.peer(), f"{what}: {refused[1]}")
            context.abort(refused[0], f"{where}: {refused[1]}")
        # With TLS the certificate must name the site; without, the check below.
        gate.refuse_unless_named(context, site, "PullState")
        # The asking site's share of the slots, for the check and the stream only.
        self.pulls.hold_for_stream(context, site, PULL_STATE_SHARE)
        ask = lane_pb2.ConfirmPullRequest(
            nonce=request.nonce,
            generation=request.generation,
            step=request.step,
            rank=me,
            source=offer.admitted.source,
        )
        try:
            offer.admitted.confirm(site, rank, ask, budget(context))
        except grpc.RpcError as exc:
            gate.forged_or_unreached(
                context,
                exc,
                f"{what} that the rank did not ask for",
                f"{where}: {what}: the rank did not ask",
                f"{where}: could not ask {site} rank {rank}'s lane to confirm the pull",
            )
        why = offers.begin(offer, site, rank)
        if why is not None:
            gate.refusals.note(context.peer(), f"{what}: {why}")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {why}")
        context.add_callback(lambda: offers.end(offer, site, rank, complete=False))
        log.info("[site %d rank %d] serving the state after step %d to %s rank %d",
                 site_index, me, request.step, site, rank)  # fmt: skip
        complete = False
        try:
            yield from pieces(offer.state)
            complete = True
        finally:
            offers.end(offer, site, rank, complete=complete)

    def _offer(
        self, request: lane_pb2.PullStateRequest, context: grpc.ServicerContext, where: str
    ) -> Offer:
        """The state offered after ``request.step``; the call aborted when there is none."""
        offer = self.offers.find(request.generation, request.step)
        if offer is None:
            if self.offers.gone(request.generation, request.step):
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"{where} offers the state after step {request.step} no more: pulled "
                    "by every rank it was offered to, or its deadline passed",
                )
            # Not offered yet (it is, after the step that admitted the joiner): the
            # joining rank asks again. Nothing is held while it waits.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{where} offers no state after step {request.step} in generation "
                f"{request.generation} yet: ask again",
            )
        assert offer is not None  # context.abort raised
        return offer


PULL_STATE_SHARE = 2
"""``PullState`` calls one asking site holds at once (its ranks between sites of
another size may pull from this one rank; a rank pulls once at a time)."""
