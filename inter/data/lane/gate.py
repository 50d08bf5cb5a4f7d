"""Who a lane's calls and chunks come from, and whose name they may carry.

With mutual TLS a caller speaks for the site its certificate names; without, a chunk
is taken only on a ticket or pass granted to the site it claims to come from
(``Tickets``), so that another caller cannot push chunks in a member's name (issue 14,
row 9; issue 33, row 8). The lane's server and its handlers check through one
:class:`LaneGate`, which reads the membership the server holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc

from isthmus.inter.bounds import RefusalLog
from isthmus.inter.data.lane.mailbox import NONCE_BYTES
from isthmus.inter.data.round.context import Members
from isthmus.inter.data.transport.bulk import Tickets
from isthmus.inter.data.transport.chunk_checks import Refused
from isthmus.inter.security import TLS_NAME, SiteSecurity, refuse_unless_named

__all__ = ["ANY_SENDER", "PASS_METADATA", "LaneGate", "code_of", "holder_of"]

ANY_SENDER = object()
"""``LaneServer.take``'s holder when the sender was checked already (mutual TLS)."""
PASS_METADATA = "isthmus-lane-pass"
"""gRPC metadata key of the ticket a ``PushChunks`` stream presents without TLS (hex)."""


def code_of(exc: grpc.RpcError) -> grpc.StatusCode | None:
    return exc.code() if hasattr(exc, "code") else None


def holder_of(site_names: tuple[str, ...] | None, site: int) -> str:
    """Who a ticket for ``site`` is bound to: its name when the membership names the
    sites (an index moves when a site leaves), else its index."""
    if site_names is not None and site < len(site_names):
        return site_names[site]
    return str(site)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaneGate:
    """The checks of one lane's callers."""

    security: SiteSecurity
    where: str
    """The lane, for log lines and refusals ("lane of site 0")."""
    refusals: RefusalLog
    tickets: Tickets  # the bulk tickets and passes the lane granted, each bound to a site
    members: Callable[[], Members]
    """The membership the lane holds now (it changes with the generation)."""

    def in_generation(self, context: grpc.ServicerContext, generation: int) -> Members:
        """The membership; the call refused unless ``generation`` is its own."""
        members = self.members()
        if generation != members.generation:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"site {members.site_index}: generation {generation} != {members.generation}",
            )
        return members

    def refuse_unless_peer(self, context: grpc.ServicerContext, site: int) -> None:
        """Refuses a call for ``site`` unless it is another member of the membership."""
        members = self.members()
        if site >= members.num_sites or site == members.site_index:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"from_site {site} is not another member of {members.num_sites} sites",
            )

    def refuse_unless_nonce(self, context: grpc.ServicerContext, nonce: bytes) -> None:
        """Refuses a call whose nonce is not :data:`NONCE_BYTES` long."""
        if len(nonce) != NONCE_BYTES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"nonce of {len(nonce)} bytes, not {NONCE_BYTES}"
            )

    def refuse_unless_named(self, context: grpc.ServicerContext, site: str, method: str) -> None:
        refuse_unless_named(self.security, context, self.where, site, method)

    def refuse_unless_sender(
        self, context: grpc.ServicerContext, from_site: int, method: str
    ) -> None:
        """With mutual TLS, a call for site ``from_site`` (a chunk it sends, a chunk sent
        to it) only from a certificate naming that member: another site of the job
        cannot push chunks in its name or pull what was sent to it (issue 14, row 9).
        Called per chunk: without TLS it returns before anything else."""
        if not self.security.require_tls:
            return
        names = self.members().site_names
        if names is not None and from_site < len(names):
            self.refuse_unless_named(context, names[from_site], method)

    def check_holder(self, from_site: int, holder: str | None | object, peer: str) -> None:
        """Refuses a chunk "from ``from_site``" unless the ticket or pass it came with
        was granted to that site: an injected chunk is refused before it can take the
        real one's place in the mailbox (issue 33, row 8). Logged once per caller."""
        if holder is ANY_SENDER:
            return
        if holder is None:
            why = f"chunk in site {from_site}'s name without a ticket or pass granted to it"
        elif holder != holder_of(self.members().site_names, from_site):
            why = f"chunk in site {from_site}'s name on a ticket granted to {holder}"
        else:
            return
        self.refusals.note(peer or "a caller", why)
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, why)

    def forged_or_unreached(
        self,
        context: grpc.ServicerContext,
        exc: grpc.RpcError,
        noted: str,
        denied: str,
        unreached: str,
    ) -> None:
        """Aborts a call that this lane passed on to a peer's lane (a hand-off, a pull's
        check), which failed with ``exc``: PERMISSION_DENIED (``denied``) when that lane
        did not ask, so the call was forged (``noted``, once per caller); else
        UNAVAILABLE (``unreached``, with the failure's code and details)."""
        code = code_of(exc)
        if code == grpc.StatusCode.PERMISSION_DENIED:
            self.refusals.note(context.peer(), noted)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        details = exc.details() if hasattr(exc, "details") else str(exc)
        context.abort(
            grpc.StatusCode.UNAVAILABLE, f"{unreached}: {getattr(code, 'name', code)}: {details}"
        )

    def vouches(self, holder: str, names: frozenset[str]) -> bool:
        """Whether a TLS certificate naming ``names`` may carry chunks on a ticket granted
        to ``holder``: only if it names that site, where the membership names sites
        (as :meth:`refuse_unless_sender` checks a gRPC call)."""
        return self.members().site_names is None or holder in names

    def pass_holder(self, context: grpc.ServicerContext) -> str | None:
        """The site a stream's pass (a ticket in its metadata) was granted to, or None."""
        for key, value in context.invocation_metadata() or ():
            if key == PASS_METADATA and isinstance(value, str) and len(value) <= 128:
                try:
                    return self.tickets.holder(bytes.fromhex(value))
                except ValueError:
                    return None
        return None

    def stream_holder(self, context: grpc.ServicerContext, holder: str | None | object) -> str:
        """The peer site a ``PushChunks`` stream comes from: its certificate's (TLS) or
        its pass's; refused (PERMISSION_DENIED, logged) when that is no peer of this
        lane: no pass, or this very site (it never sends its own lane a chunk)."""
        members = self.members()
        own = holder_of(members.site_names, members.site_index)
        if holder is ANY_SENDER:
            names = context.auth_context().get("x509_subject_alternative_name", [])
            named = {n.decode("utf-8", "replace") for n in names}
            peers = named - {own, TLS_NAME}
            if members.site_names is not None:
                peers &= set(members.site_names)
            found = min(peers) if peers else None
            why = f"PushChunks stream whose certificate names no peer site of {own}"
        elif holder is None:
            found, why = None, "PushChunks stream without a ticket or pass granted to a peer"
        else:
            found = holder if holder != own else None
            why = f"PushChunks stream on a pass granted to {own} itself"
        if found is None:
            self.refusals.note(context.peer(), why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return f"site {found}"
