"""Which process speaks for each rank of a site: a key drawn by the rank itself.

The job token (inter/security.py) says that a caller belongs to the job, not which
rank it is, and without it anyone on the machine can call a coordinator. A rank
therefore draws a random key once per process and registers it with its lane
(``RegisterRank``); from then on the coordinator counts a vote (``CommitStep``) only
with the key of the rank it names, and takes the site's own digest
(``ReportProgress``) only with a key of one of its ranks. A second registration of
the same rank with another key is refused: the first process to register a rank owns
it for the coordinator's life (a rank that retries its registration sends the same
key). The key never leaves the site: ranks reach their own coordinator only.
"""

from __future__ import annotations

import hmac
import secrets
import threading

__all__ = ["RANK_KEY", "RankKeys"]

RANK_KEY = secrets.token_hex(16)
"""This process's key, sent with its rank's calls to its own coordinator."""

MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 64


class RankKeys:
    """The key each rank of one site registered with (thread-safe)."""

    def __init__(self, site: str) -> None:
        self.site = site
        self._keys: dict[int, str] = {}
        self._lock = threading.Lock()

    def register(self, rank: int, key: str) -> str | None:
        """Records ``rank``'s key; returns why it is refused, or None."""
        if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
            return (
                f"rank_key must have {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters, got {len(key)}"
            )
        with self._lock:
            known = self._keys.setdefault(rank, key)
        if not hmac.compare_digest(known.encode(), key.encode()):
            return (
                f"rank {rank} of {self.site} is already registered by another process "
                "(a second launch of the same site?)"
            )
        return None

    def is_rank(self, rank: int, key: str) -> bool:
        """Whether ``key`` is the one ``rank`` registered with."""
        with self._lock:
            known = self._keys.get(rank)
        return known is not None and hmac.compare_digest(known.encode(), key.encode())

    def is_any_rank(self, key: str) -> bool:
        """Whether ``key`` is the key of some registered rank of the site."""
        with self._lock:
            known = list(self._keys.values())
        return any(hmac.compare_digest(k.encode(), key.encode()) for k in known)
