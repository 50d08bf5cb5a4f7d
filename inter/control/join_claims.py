"""What joins in a site's name claimed, kept until the site's own answer settles them.

A join can come from anyone who reaches a coordinator's port (inter/control/admission.py
says why nothing is admitted from it). What it claimed (lanes, incarnation) is kept per
caller, only ever to be compared with what the site answers at its own address: a claim
that answer contradicts was not the site's own, and its caller is reported.
"""

from __future__ import annotations

from isthmus.proto import coordinator_pb2 as pb

__all__ = ["MAX_CLAIMS_PER_SITE", "JoinClaims"]

MAX_CLAIMS_PER_SITE = 16  # unsettled joins kept per site name (the oldest go first)


class JoinClaims:
    """What joins in each site's name claimed (lanes, incarnation), by caller, until the
    site's own answer settles them. Guarded by the coordinator state's condition."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {}

    def claim(self, name: str, caller: str, info: pb.SiteInfo, incarnation: str) -> None:
        """A join from ``caller`` said ``name`` is ready with ``info``'s lanes."""
        claims = self._pending.setdefault(name, {})
        claims.pop(caller, None)
        claims[caller] = (tuple(info.lane_addresses), incarnation)
        while len(claims) > MAX_CLAIMS_PER_SITE:
            del claims[next(iter(claims))]

    def settle(self, name: str, info: pb.SiteInfo, incarnation: str) -> list[str]:
        """``name`` answered at its own address with ``info``: returns the callers whose
        claims differ (they were not its own); every claim in its name is settled."""
        lanes = tuple(info.lane_addresses)
        return [
            caller
            for caller, (claimed, claimed_incarnation) in self._pending.pop(name, {}).items()
            if claimed != lanes or (incarnation and claimed_incarnation != incarnation)
        ]
