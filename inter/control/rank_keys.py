"""Which process speaks for each rank of a site: a key its launcher handed it.

The job token (inter/security.py) says that a caller belongs to the job, not which rank it
is, and without it anyone on the machine can call a coordinator. Each rank therefore
registers with a key, and from then on the coordinator counts a vote only with the key of
the rank it names, and takes the site's own digest only with a key of one of its ranks.

Which key a rank may register with is decided before the rank starts (issue 33, row 6: a
stranger that registered rank 0 first once stopped the site). A coordinator draws one
random key per rank (:meth:`RankKeys.draw`); the launcher of the site's ranks
(deploy/launch/ranks.py), in the coordinator's process, finds them with :func:`handout` by
the coordinator's address and hands each rank its own in the environment (:data:`KEY_ENV`).
Ranks that another launcher starts (Slurm's ``srun``) derive theirs from a site secret in a
0600 file (:data:`SECRET_FILE_ENV`, :func:`derived_key`), which ``isthmus coordinator
--rank-secret-file`` reads too. Any other key is refused and changes nothing. Only
:meth:`RankKeys.first_come` (``isthmus coordinator`` without a secret file) keeps the old
rule: the first process to register a rank owns it. The key never leaves the site.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "KEY_ENV",
    "SECRET_FILE_ENV",
    "KeyRefusal",
    "RankKeys",
    "derived_key",
    "handout",
    "own_key",
    "process_key",
    "publish",
    "read_secret",
    "withdraw",
]

KEY_ENV = "ISTHMUS_RANK_KEY"
"""The environment variable a launcher hands a rank its key in."""
SECRET_FILE_ENV = "ISTHMUS_RANK_SECRET_FILE"
"""The environment variable naming a site secret file ranks derive their keys from."""
MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 64
MIN_SECRET_BYTES = 16


def derived_key(secret: bytes, site: str, rank: int) -> str:
    """The key of ``rank`` of ``site`` under a site secret (HMAC-SHA256, 32 hex digits)."""
    return hmac.new(secret, f"{site}/{rank}".encode(), hashlib.sha256).hexdigest()[:32]


def read_secret(path: str | Path) -> bytes:
    """A site secret file's bytes (stripped); ``ValueError`` when shorter than 16 bytes
    or readable by other users."""
    path = Path(path)
    if path.stat().st_mode & 0o077:
        raise ValueError(f"rank secret file {path} must be readable by its owner only (0600)")
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"rank secret file {path} holds {len(secret)} bytes, need >= 16")
    return secret


def own_key(env: Mapping[str, str] = os.environ) -> str:
    """This process's key: the one its launcher handed it (:data:`KEY_ENV`), derived
    from the site secret file (:data:`SECRET_FILE_ENV`, with ``ISTHMUS_SITE`` and
    ``RANK`` or ``SLURM_PROCID``), else a random one (a rank of a first-come site)."""
    handed = env.get(KEY_ENV, "")
    if handed:
        return handed
    secret_file = env.get(SECRET_FILE_ENV, "")
    rank = env.get("RANK", env.get("SLURM_PROCID", ""))
    if secret_file and rank.isdigit() and env.get("ISTHMUS_SITE"):
        return derived_key(read_secret(secret_file), env["ISTHMUS_SITE"], int(rank))
    return secrets.token_hex(16)


@functools.cache
def process_key() -> str:
    """This process's key, sent with its rank's calls to its own coordinator. Read on
    first use, not at import: a rank forked from its launcher's zygote
    (deploy/launch/zygote.py) is handed its environment after the imports."""
    return own_key()


@dataclass(frozen=True, slots=True)
class KeyRefusal:
    """Why a registration was refused."""

    why: str
    stranger: bool
    """The key is not the one the rank was handed: the caller is not the rank
    (PERMISSION_DENIED), rather than a malformed or conflicting request."""


class RankKeys:
    """The key each rank of one site registers with (thread-safe). ``handed``: the key
    handed to each rank, by rank; None: the first key a rank registers with is its key
    (ranks no launcher of ours starts)."""

    def __init__(self, site: str, handed: Sequence[str] | None = None) -> None:
        self.site = site
        self._handed = tuple(handed) if handed is not None else None
        self._keys: dict[int, str] = {}
        self._digests: dict[bytes, int] = {}
        """sha256 of every registered key -> its rank: :meth:`is_any_rank` answers every
        membership poll of every rank, so it looks the key up instead of comparing it
        with each rank's (N compares a poll, N polls a second: O(N²) at 4,096 ranks).
        Looking up the key's digest, not the key, leaks nothing of a key through timing."""
        self._lock = threading.Lock()

    @classmethod
    def draw(cls, site: str, ranks: int) -> RankKeys:
        """One random key per rank, for the launcher to hand out (:func:`handout`)."""
        return cls(site, [secrets.token_hex(16) for _ in range(ranks)])

    @classmethod
    def derive(cls, site: str, ranks: int, secret: bytes) -> RankKeys:
        """The keys ranks derive from a site secret file (:func:`own_key`)."""
        return cls(site, [derived_key(secret, site, r) for r in range(ranks)])

    @classmethod
    def first_come(cls, site: str) -> RankKeys:
        """The first key a rank registers with is its key."""
        return cls(site, None)

    @property
    def bound(self) -> bool:
        """Whether each rank's key was fixed before it started."""
        return self._handed is not None

    def handed(self, rank: int) -> str:
        """The key handed to ``rank`` (only for a bound site)."""
        if self._handed is None:
            raise ValueError(f"{self.site} hands its ranks no keys (first come)")
        return self._handed[rank]

    def handed_keys(self) -> tuple[str, ...] | None:
        return self._handed

    def register(self, rank: int, key: str) -> KeyRefusal | None:
        """Records ``rank``'s key; returns why it is refused, or None."""
        if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
            return KeyRefusal(
                f"rank_key must have {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters, got {len(key)}",
                stranger=self.bound,
            )
        if self._handed is not None:
            # Constant-time: the key is compared with the secret handed to the rank.
            if rank >= len(self._handed) or not _same(self._handed[rank], key):
                return KeyRefusal(
                    f"rank {rank} of {self.site} registers with the key its launcher "
                    "handed it, not this one",
                    stranger=True,
                )
            with self._lock:
                self._record_locked(rank, key)
            return None
        with self._lock:
            known = self._keys.get(rank, key)
            if rank not in self._keys:
                self._record_locked(rank, key)
        if not _same(known, key):
            return KeyRefusal(
                f"rank {rank} of {self.site} is already registered by another process "
                "(a second launch of the same site?)",
                stranger=False,
            )
        return None

    def _record_locked(self, rank: int, key: str) -> None:
        self._keys[rank] = key  # a rank's key never changes once registered
        self._digests[_digest(key)] = rank

    def is_rank(self, rank: int, key: str) -> bool:
        with self._lock:
            known = self._keys.get(rank)
        return known is not None and _same(known, key)

    def speaks_for(self, rank: int, key: str) -> bool:
        """Whether ``key`` is ``rank``'s: the one it registered with, or, before it
        registered, the one its launcher handed it (a script may raise before it joins)."""
        handed = self._handed
        return self.is_rank(rank, key) or (
            handed is not None and rank < len(handed) and _same(handed[rank], key)
        )

    def is_any_rank(self, key: str) -> bool:
        return self.rank_of(key) is not None

    def rank_of(self, key: str) -> int | None:
        digest = _digest(key)
        with self._lock:
            return self._digests.get(digest)


def _same(known: str, key: str) -> bool:
    return hmac.compare_digest(known.encode(), key.encode())  # in constant time


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# The launcher of a site's ranks runs in its coordinator's process (deploy/launch/local.py,
# deploy/launch/site.py) and knows the coordinator by its address only: it finds the keys to
# hand out here. Keyed by the bound address, unique in a process while it is bound.
_HANDOUTS: dict[str, RankKeys] = {}
_HANDOUTS_LOCK = threading.Lock()


def publish(address: str, keys: RankKeys) -> None:
    """The coordinator at ``address`` (in this process) takes these keys."""
    with _HANDOUTS_LOCK:
        _HANDOUTS[address] = keys


def withdraw(address: str) -> None:
    """The coordinator at ``address`` stopped."""
    with _HANDOUTS_LOCK:
        _HANDOUTS.pop(address, None)


def handout(address: str) -> tuple[str, ...] | None:
    """The keys to hand the ranks of the coordinator at ``address``, by rank, if that
    coordinator runs in this process and binds its ranks' keys; else None."""
    with _HANDOUTS_LOCK:
        keys = _HANDOUTS.get(address)
    return keys.handed_keys() if keys is not None else None
