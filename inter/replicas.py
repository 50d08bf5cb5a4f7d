"""Replica digests: every site reports sha256 digests of its full parameters, and
any two that differ for the same step are a divergence (docs/design.md invariant 1)."""

from __future__ import annotations

import logging
import re
import threading

log = logging.getLogger(__name__)

DIGEST = re.compile(r"^[0-9a-f]{64}$")
KEEP_STEPS = 16  # digests kept per site; comparisons only need the recent ones


class ReplicaDigests:
    """Thread-safe record of (site, step) -> digest, with divergence detection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_site: dict[str, dict[int, str]] = {}
        self.divergence: str | None = None

    @staticmethod
    def valid(digest: str) -> bool:
        return digest == "" or bool(DIGEST.match(digest))

    def record(self, site: str, step: int, digest: str) -> str | None:
        """Store one digest; returns the divergence message if it disagrees with a peer's."""
        if not digest:
            return self.divergence
        with self._lock:
            mine = self._by_site.setdefault(site, {})
            mine[step] = digest
            for old in sorted(mine)[:-KEEP_STEPS]:
                del mine[old]
            for other, digests in self._by_site.items():
                theirs = digests.get(step)
                if (
                    other != site
                    and theirs is not None
                    and theirs != digest
                    and not self.divergence
                ):
                    self.divergence = (
                        f"replicas differ after step {step}: {site} has {digest[:16]}, "
                        f"{other} has {theirs[:16]}"
                    )
                    log.error(self.divergence)
            return self.divergence

    def latest(self) -> dict[str, tuple[int, str]]:
        """site -> (step, digest) of its newest digest."""
        with self._lock:
            return {site: max(d.items()) for site, d in self._by_site.items() if d}

    def agree_at(self, step: int, sites: list[str]) -> bool | None:
        """True if every site has reported the same digest for `step`; None while any is missing."""
        with self._lock:
            found = [self._by_site.get(site, {}).get(step) for site in sites]
        if any(d is None for d in found):
            return None
        return len(set(found)) == 1
