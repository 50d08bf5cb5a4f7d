"""The witness: a coordinator-only process at a third place that breaks even splits.

Without one, a job split into two equal halves goes on on the side holding its first
site (inter/control/leader.py), so two sites survive the loss of site1 but not of site0.
With a witness (``cluster.witness``; run it with ``isthmus witness``), a side holding
exactly half the sites goes on only with the witness's *grant*:

* the witness backs one side at a time, its **holder** (none at first);
* it grants a side that contains the holder (the same sites, or more), and a side
  without some of the holder's sites only once those have been silent at the witness
  for ``failure_timeout_s`` (every site pings it each heartbeat period);
* so when a site dies the other is granted, and when the two sites are cut apart but
  both still reach the witness, the first to ask is granted and the other waits, as
  two-node clusters do with a quorum disk.

A site that cannot reach the witness never has half on its own; a majority never
needs it. Grants and pings carry the job fingerprint; with mutual TLS a caller speaks
only for the site its certificate names (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import grpc

from isthmus.inter.control.arrivals import FLOOR_PERIODS, ArrivalDeadlines
from isthmus.inter.control.channels import add_port, control_server, peer_channel
from isthmus.inter.control.fingerprint import fingerprint_problem
from isthmus.inter.control.settings import CoordinatorSettings
from isthmus.inter.security import INSECURE, SiteSecurity, refuse_unless_named
from isthmus.proto import coordinator_pb2 as pb
from isthmus.proto import coordinator_pb2_grpc as pb_grpc

__all__ = ["HOST_KEYS", "SCRIPT_KEYS", "WitnessLink", "WitnessServer"]

log = logging.getLogger(__name__)

HOST_KEYS = frozenset({"sync.chunk_bytes"})
"""Fingerprint keys a site derives from its own host, which the witness leaves out: on
``topology.device = "auto"`` a site with GPUs sends larger chunks than the link alone
asks for (deploy/config/job.py), and the witness, which moves no chunks, typically runs
on a host without them. Sites still compare these keys with each other."""
SCRIPT_KEYS = frozenset({"run.script_sha256", "run.script_args"})
"""The user's script, which each site's launcher pins from its ``--script``; the witness
runs none (``isthmus witness`` takes no script), so it leaves them out too."""
UNSEEN_KEYS = HOST_KEYS | SCRIPT_KEYS
"""Fingerprint keys the witness does not compare."""


class WitnessServer(pb_grpc.WitnessServicer):
    """The witness process's gRPC server: every caller must match ``fingerprint``; a site
    silent past the deadline its pings (every ``heartbeat_s``) teach, at most
    ``failure_timeout_s`` (on ``clock``), is taken for dead (``arrivals.py``)."""

    def __init__(
        self,
        *,
        site_names: list[str],
        fingerprint: Mapping[str, str],
        failure_timeout_s: float,
        heartbeat_s: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        security: SiteSecurity | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.site_names = list(site_names)
        self.fingerprint = {k: v for k, v in fingerprint.items() if k not in UNSEEN_KEYS}
        self.failure_timeout_s = failure_timeout_s
        self.security = security or INSECURE
        self.where = "witness"
        self.holder: list[str] = []
        # None: a fixed failure timeout (a floor of FLOOR_PERIODS periods is the ceiling)
        period = failure_timeout_s / FLOOR_PERIODS if heartbeat_s is None else heartbeat_s
        self._arrivals = ArrivalDeadlines(
            period_s=period, ceiling_s=failure_timeout_s, clock=clock
        )  # guarded by _lock
        self._started = clock()
        self._lock = threading.Lock()
        interceptors = self.security.server_interceptors(self.where)
        self._server = control_server(8, "witness", interceptors)
        pb_grpc.add_WitnessServicer_to_server(self, self._server)
        bound = add_port(self._server, self.security, f"{host}:{port}", "witness")
        self.address = f"{host}:{bound}"

    def start(self) -> WitnessServer:
        self._server.start()
        log.info("witness of %s listening on %s", ", ".join(self.site_names), self.address)
        return self

    def stop(self, grace_s: float = 0.5) -> None:
        self._server.stop(grace_s).wait(timeout=grace_s + 5)

    def _check(self, site: str, fingerprint: pb.JobFingerprint, context, method: str) -> None:
        refuse_unless_named(self.security, context, self.where, site, method)
        if site not in self.site_names:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown site {site[:64]!r}")
        problem = fingerprint_problem(
            self.fingerprint,
            {k: v for k, v in fingerprint.fields.items() if k not in UNSEEN_KEYS},
            self.where,
            site,
            values=self.security.require_token or self.security.require_tls,
        )
        if problem is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)

    def Ping(self, request, context):  # noqa: N802 (gRPC method name)
        self._check(request.site, request.fingerprint, context, "Ping")
        with self._lock:
            self._arrivals.heard(request.site)
        return pb.WitnessPingResponse()

    def Grant(self, request, context):  # noqa: N802
        self._check(request.site, request.fingerprint, context, "Grant")
        members = list(request.members)
        if (
            request.site not in members
            or len(set(members)) != len(members)
            or any(m not in self.site_names for m in members)
        ):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"members must be distinct sites of the job including {request.site[:64]!r}",
            )
        with self._lock:
            self._arrivals.heard(request.site)
            why = self._refusal_locked(members)
            if why is None:
                if set(members) != set(self.holder):
                    log.warning("witness: backing %s now", ", ".join(members))
                self.holder = sorted(members, key=self.site_names.index)
            return pb.WitnessGrantResponse(
                granted=why is None, reason=why or "", holder=self.holder
            )

    def _refusal_locked(self, members: list[str]) -> str | None:
        if 2 * len(members) != len(self.site_names):
            return f"{len(members)} of {len(self.site_names)} sites is not an even split"
        alive = [
            s
            for s in self.holder
            if s not in members and not self._arrivals.silent(s, self._started)
        ]
        if alive:
            return f"the witness backs {', '.join(self.holder)}, and {', '.join(alive)} is alive"
        return None


class WitnessLink:
    """A coordinator's line to the witness: pings it every ``heartbeat_s`` and asks for
    grants, on its own thread, so that a witness that does not answer never holds up
    the coordinator. ``granted`` answers from what the witness last said (stale after two
    periods); ``on_answer`` is called when a grant's answer arrives (the leader re-evaluates).
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        security: SiteSecurity,
        *,
        on_answer: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address, self.site = settings.witness or "", settings.site
        self._fingerprint = pb.JobFingerprint(fields=dict(settings.fingerprint))
        self._heartbeat_s, self._rpc_timeout_s = settings.heartbeat_s, settings.rpc_timeout_s
        self._channel = peer_channel(self.address, security=security)
        self._stub = pb_grpc.WitnessStub(self._channel)
        self._on_answer = on_answer
        self._clock = clock
        self._lock = threading.Lock()
        self._wanted: frozenset[str] | None = None
        self._answers: dict[frozenset[str], tuple[bool, float]] = {}
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._said: dict[str, str] = {}  # the last warning of each kind, logged when it changes
        self._thread = threading.Thread(target=self._run, name=f"witness-{self.site}", daemon=True)

    def start(self) -> WitnessLink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(self._rpc_timeout_s + 1)
        self._channel.close()

    def granted(self, members: Iterable[str]) -> bool:
        """Whether the witness backs ``members`` going on, from its answer of the last
        heartbeat period; asks it (in the background) when there is none yet."""
        wanted = frozenset(members)
        with self._lock:
            answer = self._answers.get(wanted)
            if answer is not None and self._clock() - answer[1] <= 2 * self._heartbeat_s:
                return answer[0]
            self._wanted = wanted
        self._wake.set()
        return False

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                wanted, self._wanted = self._wanted, None
            try:
                if wanted is not None:
                    self._ask(wanted)
                else:
                    ping = pb.WitnessPingRequest(site=self.site, fingerprint=self._fingerprint)
                    self._stub.Ping(ping, timeout=self._rpc_timeout_s)
                    self._say("ping", "")
            except grpc.RpcError as exc:
                if not self._stopped.is_set():
                    self._say("ping", f"[{self.site}] witness {self.address}: {exc.code().name}")
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()

    def _ask(self, members: frozenset[str]) -> None:
        request = pb.WitnessGrantRequest(
            site=self.site, members=sorted(members), fingerprint=self._fingerprint
        )
        reply = self._stub.Grant(request, timeout=self._rpc_timeout_s)
        if not reply.granted:
            self._say(
                "grant",
                f"[{self.site}] the witness does not back {sorted(members)}: {reply.reason}",
            )
        with self._lock:
            self._answers[members] = (reply.granted, self._clock())
        self._on_answer()

    def _say(self, kind: str, warning: str) -> None:
        """Logs ``warning`` when it differs from the last of its kind ("" = all is well)."""
        if warning and warning != self._said.get(kind):
            log.warning("%s", warning)
        self._said[kind] = warning
