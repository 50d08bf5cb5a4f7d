"""What a site's coordinator is built with: one frozen, validated value.

The coordinator (inter/control/coordinator.py) and the helpers it hands them to (the
failover loop, the peer loop, the admission rule, the witness link) read their
settings from one :class:`CoordinatorSettings`, not from the coordinator object, so
each helper is given only what it uses and none of them imports the coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["CoordinatorSettings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorSettings:
    """One site's coordinator settings (checked on creation; a bad one raises ValueError)."""

    site: str
    """This site's name; must be in ``site_names``."""
    site_names: tuple[str, ...]
    """Every site of the job, in index order (fixes summation order and the leader)."""
    ranks: int
    """Ranks expected to register from this site."""
    fingerprint: Mapping[str, str]
    """The flattened job fingerprint every party must match."""
    site_ranks: tuple[int, ...] = ()
    """Each site's rank count, by index (sites may differ in size; one lane per rank);
    empty: every site has ``ranks``."""
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 0
    """Port to bind; 0 picks a free one (the coordinator's ``address`` tells which)."""
    join_timeout_s: float = 120.0
    """How long to wait for every site to be present and ready."""
    rpc_timeout_s: float = 5.0
    """Deadline of each RPC to a peer."""
    heartbeat_s: float = 1.0
    """Period of heartbeats to peers (and pings to the witness) once joined."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (0 = any free port); None serves none."""
    failure_timeout_s: float = 10.0
    """The most a member may be silent before it is suspected dead; its own deadline
    follows its arrivals (``arrivals.py``)."""
    min_sites: int = 1
    """Never go on with fewer live sites."""
    quorum_wait_s: float = 60.0
    """How long a site without quorum waits before it stops."""
    vote_window: int = 64
    """Votes for steps more than this past the step the site runs are refused (forged
    votes for coming steps once froze a job: issue 14, row 3)."""
    first_step: int = 0
    """A resumed job's first step."""
    witness: str | None = None
    """host:port of the job's witness (inter/control/witness.py), if it has one."""
    peers: frozenset[str] = field(init=False)
    """The other sites' names."""

    def __post_init__(self) -> None:
        names = tuple(self.site_names)
        object.__setattr__(self, "site_names", names)
        object.__setattr__(self, "fingerprint", dict(self.fingerprint))
        object.__setattr__(self, "peers", frozenset(names) - {self.site})
        if self.site not in names:
            raise ValueError(f"site {self.site!r} is not one of the job's sites {list(names)}")
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        sizes = tuple(self.site_ranks) or (self.ranks,) * len(names)
        object.__setattr__(self, "site_ranks", sizes)
        if len(sizes) != len(names) or sizes[self.index] != self.ranks:
            raise ValueError(
                f"site_ranks {list(sizes)} must give each of {len(names)} sites its "
                f"ranks, {self.ranks} for {self.site}"
            )
        if self.failure_timeout_s <= 0:
            raise ValueError(f"failure_timeout_s must be > 0, got {self.failure_timeout_s}")
        if self.quorum_wait_s < 0 or self.min_sites < 1 or self.vote_window < 1:
            raise ValueError(
                "need quorum_wait_s >= 0, min_sites >= 1 and vote_window >= 1, got "
                f"{self.quorum_wait_s}, {self.min_sites}, {self.vote_window}"
            )

    @property
    def index(self) -> int:
        """This site's index in ``site_names``."""
        return self.site_names.index(self.site)

    @property
    def where(self) -> str:
        """How refusals and logs name this coordinator."""
        return f"coordinator of {self.site}"
