"""Which process each site's coordinator runs in: a restart shows as a new incarnation.

Every coordinator process draws a random id and sends it with its joins and its
answers to joins. A member that joins with another id than the one the job knows was
restarted, even before the job's first commit (in DiLoCo that comes only after
``sync.inner_steps`` steps), so its earlier incarnation is taken for dead at once.
"""

from __future__ import annotations

import secrets

MAX_INCARNATION_CHARS = 64


class Incarnations:
    """This process's id and the one each peer was last known by (guarded by the
    coordinator's lock)."""

    def __init__(self) -> None:
        self.mine = secrets.token_hex(8)
        self._known: dict[str, str] = {}

    @staticmethod
    def problem(site: str, incarnation: str) -> str | None:
        """Why a peer's id is refused, or None."""
        if len(incarnation) > MAX_INCARNATION_CHARS:
            return (
                f"site {site} sent an incarnation of {len(incarnation)} characters "
                f"(max {MAX_INCARNATION_CHARS})"
            )
        return None

    def renew(self) -> None:
        """This site starts anew in the same process (its ranks died and start again):
        its peers take the earlier incarnation for dead, as after a restart."""
        self.mine = secrets.token_hex(8)

    def get(self, site: str) -> str | None:
        return self._known.get(site)

    def is_new(self, site: str, incarnation: str) -> bool:
        """Whether ``incarnation`` is another process than the one ``site`` is known by."""
        known = self._known.get(site)
        return bool(known and incarnation and known != incarnation)

    def learn(self, site: str, incarnation: str, *, replace: bool) -> None:
        """Remember ``site``'s id: the first one always, a different one only if
        ``replace`` (until a restarted site is admitted, its earlier id is the job's)."""
        if incarnation and (replace or site not in self._known):
            self._known[site] = incarnation
