"""What a lane hands only to a site of its rounds, at the address its rounds know.

Without TLS nothing binds a gRPC caller to a site's name, and an answer goes to whoever
called (issue 33). So a chunk asked for again (``ResendChunk``) goes to the asking site's
own lane in a ``DeliverChunk`` call (row 7: twenty live gradient chunks once went to a
caller in site1's name), and a bulk ticket (``OpenBulk``) is granted to that lane in a
``GrantBulk`` call, bound to its site (row 8). Each request carries a nonce the asking
lane made (``mailbox.Handoffs``), and that lane takes only what answers a nonce of its
own: a stranger can neither ask in a site's name and receive, nor hand a site what it
did not ask for. A hand-off goes to the address this lane's rounds talk to.

A joining rank's pull of the state (``PullState``) is answered with the state itself, so
its nonce works the other way round: the serving lane asks the joining rank's lane, at
the address the admitting commit names, whether it made the nonce (``ConfirmPull``)
before it sends a byte (issue 63).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import grpc

from isthmus.inter.data.lane.gate import LaneGate, code_of, holder_of
from isthmus.inter.data.lane.mailbox import Handoffs, Outbox
from isthmus.proto import lane_pb2

if TYPE_CHECKING:
    from isthmus.inter.data.transport.bulk import Tickets
    from isthmus.inter.data.transport.wire import Chunk, Delivery

__all__ = ["HANDOFF_TIMEOUT_S", "LaneHandoff", "budget"]

HANDOFF_TIMEOUT_S = 10.0  # one DeliverChunk, GrantBulk or ConfirmPull call


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaneHandoff:
    """The lane's ``ResendChunk``, ``DeliverChunk``, ``OpenBulk``, ``GrantBulk`` and
    ``ConfirmPull`` handlers (see the module docstring); ``LaneServer`` routes them here,
    handing it the checks of its callers, the chunks it sent and the lanes its rounds met
    (``outbox``), this rank's nonces, the bulk tickets it grants and its bulk port (0:
    none)."""

    gate: LaneGate
    outbox: Outbox
    handoffs: Handoffs
    tickets: Tickets
    bulk_port: int

    # -- the sending side answers -----------------------------------------------------

    def resend(
        self, request: lane_pb2.ResendChunkRequest, context: grpc.ServicerContext
    ) -> lane_pb2.ResendChunkResponse:
        """Hands the chunk this site sent to ``request.from_site`` to that site's lane."""
        self.gate.refuse_unless_sender(context, request.from_site, "ResendChunk")
        members = self.gate.in_generation(context, request.generation)
        key = (request.step, request.group, request.kind, request.chunk_index)
        found = self.outbox.get(key, request.from_site)
        if found is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"site {members.site_index} has no chunk {key} for site {request.from_site}",
            )
        assert found is not None  # context.abort raised
        frame, peer = found
        try:
            peer.deliver(frame, request.nonce, budget(context))
        except grpc.RpcError as exc:
            self._refused_or_failed(
                context, exc, f"ResendChunk of {key} in site {request.from_site}'s name"
            )
        return lane_pb2.ResendChunkResponse()

    def open_bulk(
        self, request: lane_pb2.OpenBulkRequest, context: grpc.ServicerContext
    ) -> lane_pb2.OpenBulkResponse:
        """Grants a ticket to the lane of ``request.from_site`` that asked for it."""
        members = self.gate.members()
        if self.gate.security.require_tls and not self.bulk_port:
            # Under TLS a ticket is only for the bulk port: a PushChunks call is vouched
            # for by its certificate, and needs no pass.
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lane of site {members.site_index} takes chunks on PushChunks only "
                "(mutual TLS is on and it has no bulk port)",
            )
        site = request.from_site
        self.gate.refuse_unless_peer(context, site)
        self.gate.refuse_unless_sender(context, site, "OpenBulk")
        self.gate.refuse_unless_nonce(context, request.nonce)
        lanes = self.outbox.peers_of(site)
        if not lanes:
            # This rank's round with that site has not begun: the asker dials again.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"lane of site {members.site_index} has no round with site {site} yet",
            )
        ticket = self.tickets.issue(holder_of(members.site_names, site))
        port = self.bulk_port
        grant = lane_pb2.GrantBulkRequest(
            nonce=request.nonce, ticket=ticket, port=port, from_site=members.site_index
        )
        failures: list[grpc.RpcError] = []
        for peer in lanes:  # one of them made the nonce (a few lanes between unequal sites)
            try:
                peer.grant_bulk(grant, budget(context))
                return lane_pb2.OpenBulkResponse(port=port)
            except grpc.RpcError as exc:
                failures.append(exc)
        self.tickets.cancel(ticket)
        what = f"OpenBulk in site {site}'s name"
        if all(code_of(exc) == grpc.StatusCode.PERMISSION_DENIED for exc in failures):
            # No lane this rank's rounds met made the nonce: a forged call, or one from a
            # lane of that site whose round with this rank has not begun yet (between
            # sites of unequal sizes a rank meets a site's lanes one round at a time).
            # The asker dials again, as before any round with its site; a forger gets
            # nothing either way. Between unequal sites the line shows once a run.
            self.gate.refusals.note(
                context.peer(),
                f"{what} that none of the site's {len(lanes)} lane(s) met so far asked for "
                "(told to dial again: a lane whose round has not begun, or a forged call)",
            )
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: none of the {len(lanes)} lane(s) of site {site} that the rounds of "
                f"site {members.site_index}'s lane met asked for it (yet)",
            )
        # A lane that could not be reached may be the one that asked.
        unreached = next(e for e in failures if code_of(e) != grpc.StatusCode.PERMISSION_DENIED)
        self._refused_or_failed(context, unreached, what)
        return lane_pb2.OpenBulkResponse()  # not reached: aborted

    def _refused_or_failed(
        self, context: grpc.ServicerContext, exc: grpc.RpcError, what: str
    ) -> None:
        """The asking site's lane would not take the hand-off: it never asked, or it
        could not be reached."""
        self.gate.forged_or_unreached(
            context,
            exc,
            f"{what} that the site did not ask for",
            f"{what}: the site did not ask",
            f"{what}: could not hand it to the site's lane",
        )

    # -- the asking side takes ----------------------------------------------------------

    def take_delivery(
        self, delivery: Delivery, context: grpc.ServicerContext
    ) -> lane_pb2.DeliverChunkResponse:
        """Takes a chunk this lane's round asked for again (``DeliverChunk``)."""
        chunk: Chunk = delivery.chunk
        self.gate.refuse_unless_sender(context, chunk.from_site, "DeliverChunk")
        key = (chunk.step, chunk.group, chunk.kind, chunk.chunk_index, chunk.from_site)
        if not self.handoffs.deliver(delivery.nonce, ("chunk", key), chunk):
            self._unasked(context, f"DeliverChunk of {key}")
        return lane_pb2.DeliverChunkResponse()

    def take_grant(
        self, request: lane_pb2.GrantBulkRequest, context: grpc.ServicerContext
    ) -> lane_pb2.GrantBulkResponse:
        """Takes a bulk ticket this lane's peer asked for (``GrantBulk``)."""
        self.gate.refuse_unless_sender(context, request.from_site, "GrantBulk")
        item = (request.port, bytes(request.ticket))
        if not self.handoffs.deliver(request.nonce, ("ticket",), item):
            self._unasked(context, f"GrantBulk from site {request.from_site}")
        return lane_pb2.GrantBulkResponse()

    # -- a pull of the training state, confirmed by the pulling rank's lane --------------

    def expect_pull(self, generation: int, step: int, rank: int, source: str) -> bytes:
        """A nonce for this rank's pull of the state after ``step`` in ``generation``
        from rank ``rank`` of site ``source``: valid until :meth:`forget`."""
        return self.handoffs.expect(_pull(generation, step, rank, source))

    def forget(self, nonce: bytes) -> None:
        self.handoffs.forget(nonce)

    def confirm_pull(
        self, request: lane_pb2.ConfirmPullRequest, context: grpc.ServicerContext
    ) -> lane_pb2.ConfirmPullResponse:
        """Answers a serving lane that asks whether this rank's lane made a pull's nonce
        (``ConfirmPull``); PERMISSION_DENIED when it did not."""
        self.gate.refuse_unless_named(context, request.source, "ConfirmPull")
        what = _pull(request.generation, request.step, request.rank, request.source)
        if not self.handoffs.made(request.nonce, what):
            self._unasked(context, f"ConfirmPull of the state after step {request.step}")
        return lane_pb2.ConfirmPullResponse()

    def _unasked(self, context: grpc.ServicerContext, what: str) -> None:
        self.gate.refusals.note(context.peer(), f"{what} for a nonce this lane did not make")
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"lane of site {self.gate.members().site_index} did not ask for it",
        )


def _pull(generation: int, step: int, rank: int, source: str) -> tuple[object, ...]:
    return ("pull", generation, step, rank, source)


def budget(context: grpc.ServicerContext) -> float:
    """Seconds a call made for a caller (a hand-off, a pull's check) may take: the
    caller's deadline, less a margin for the answer."""
    left = context.time_remaining()
    if left is None:
        return HANDOFF_TIMEOUT_S
    return max(0.001, min(HANDOFF_TIMEOUT_S, left - 0.2))
