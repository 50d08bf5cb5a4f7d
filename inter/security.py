"""Mutual TLS and the job token on every isthmus gRPC server and channel.

One :class:`SiteSecurity` per site (a rank uses its site's): the job CA, this site's
certificate and key, and the job token, read from the folder that `isthmus certs`
writes. It adds the listening port of a server (TLS that requires a client
certificate signed by the job CA, or plaintext), gives the server the interceptors
that check each call, and opens channels that present the site's certificate and
attach the token to every call. ``SiteSecurity()`` is all off: today's plaintext.

Where refusals are seen (docs/design.md invariant 6: an unauthenticated peer gets nothing):

* **Certificate refusals** (a plaintext client, no client certificate, one signed by
  another CA, an expired one) fail the TLS handshake inside gRPC's C core, before a
  single byte reaches a handler. grpcio gives Python no hook there and no peer
  address, and its tracer is not a log of ours. So the dialing side, which is always
  an isthmus process, reports it (the RpcError names the address it dialed and the
  SSL error); and the server's interceptor re-checks every call that does arrive:
  when TLS is required, a call without a TLS transport and a verified peer
  certificate (a port added without TLS by mistake) is refused and logged with
  ``context.peer()`` like a token refusal.
* **Token refusals** (missing or wrong ``x-isthmus-token``) are answered
  UNAUTHENTICATED by the interceptor before the handler runs, so the call changes no
  state, and logged at WARNING with the peer's address and the method by the server's
  :class:`~isthmus.inter.bounds.RefusalLog` (once per peer host and reason a minute,
  a bounded number of lines in all, then a summary of the rest), so a misconfigured
  peer retrying every 200 ms, or a stranger's flood, cannot flood the log.
* **Health checks** (``/grpc.health.v1.Health/``) need no token: probes (Kubernetes,
  load balancers) cannot send one and the answer says nothing but SERVING. They are
  still behind TLS when TLS is on, like everything on the port.

Names: every site certificate carries the DNS name :data:`TLS_NAME` and channels
verify the server against it (``grpc.ssl_target_name_override``), because peers are
dialed by IP, NAT address or through an HTTP CONNECT proxy, none of which is a name
a certificate could list in advance. Trust is therefore "signed by this job's CA";
the job CA is per job, so that is the boundary.
"""

from __future__ import annotations

import collections
import functools
import hmac
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from isthmus.inter.bounds import RefusalLog
from isthmus.inter.closable import ClosableChannel
from isthmus.inter.malformed import handler_parts

__all__ = [
    "HEALTH_PREFIX",
    "INSECURE",
    "TLS_NAME",
    "TOKEN_HEADER",
    "SiteSecurity",
    "aio_twin",
]

log = logging.getLogger(__name__)

TLS_NAME = "isthmus"
"""DNS name in every site certificate; channels check the server's certificate for it."""
TOKEN_HEADER = "x-isthmus-token"
"""Call metadata key carrying the job token (gRPC metadata keys are lowercase)."""
HEALTH_PREFIX = "/grpc.health.v1.Health/"
"""Methods exempt from the token (still behind TLS when it is on)."""
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True)
class SiteSecurity:
    """One site's credentials (PEM; the job CA is the only issuer trusted, both ways) and
    what its servers require: mutual TLS (``ca``, ``cert``, ``key``), the job token (which
    every outgoing call carries when set)."""

    require_tls: bool = False
    require_token: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.require_tls and not (self.ca and self.cert and self.key):
            raise ValueError("require_tls needs the CA certificate, a site certificate and its key")
        if self.require_token and not self.token:
            raise ValueError("require_token needs the job token")
        if self.token is not None:
            if len(self.token) < MIN_TOKEN_CHARS:
                raise ValueError(f"the job token must be at least {MIN_TOKEN_CHARS} characters")
            if not (self.token.isascii() and self.token.isprintable() and " " not in self.token):
                raise ValueError("the job token must be printable ASCII without spaces")

    @classmethod
    def load(
        cls,
        certs_dir: str | Path,
        site: str,
        *,
        token_file: str | Path | None = None,
        require_tls: bool = False,
        require_token: bool = False,
    ) -> SiteSecurity:
        """Read the files `isthmus certs` wrote: ca.crt, SITE.crt, SITE.key, token (default
        CERTS_DIR/token), only those a switch needs; ``ValueError`` names one unreadable."""
        folder = Path(certs_dir)

        def read(path: Path) -> bytes:
            try:
                return path.read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None

        ca = cert = key = token = None
        if require_tls:
            ca, cert, key = (
                read(folder / name) for name in ("ca.crt", f"{site}.crt", f"{site}.key")
            )
        if require_token:
            path = Path(token_file) if token_file else folder / "token"
            token = read(path).decode("ascii", errors="replace").strip()
        return cls(require_tls, require_token, ca, cert, key, token)

    @property
    def enabled(self) -> bool:
        return self.require_tls or self.require_token

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Bind ``address`` on ``server`` (mutual TLS when required, else plaintext); the
        bound port, 0 when binding failed (as gRPC's own add_*_port)."""
        try:
            if not self.require_tls:
                return server.add_insecure_port(address)
            credentials = grpc.ssl_server_credentials(
                [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
            )
            return server.add_secure_port(address, credentials)
        except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
            return 0

    def server_interceptors(
        self, where: str, refusals: RefusalLog | None = None
    ) -> list[grpc.ServerInterceptor]:
        """Interceptors for ``grpc.server(interceptors=...)``; none when all is off.
        ``where`` names who refuses in the log line ("coordinator site0")."""
        return [_Gate(self, refusals or RefusalLog(where))] if self.enabled else []

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to ``address``: mutual TLS when required, the token on every call.

        Works through an HTTP CONNECT proxy (``grpc.http_proxy`` in ``options``): TLS
        runs inside the tunnel, end to end between the two sites.
        """
        options, credentials = self._dial(options)
        if credentials is not None:
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        channel = ClosableChannel(channel)
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenAttacher(self.token))
        _AIO_TWINS[channel] = functools.partial(self.aio_channel, address, tuple(options))
        return channel

    def _dial(self, options: Sequence[tuple[str, Any]]) -> tuple[list, Any]:
        """A channel's options and its TLS credentials (None: plaintext)."""
        if not self.require_tls:
            return list(options), None
        tls = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        return [*options, ("grpc.ssl_target_name_override", TLS_NAME)], tls

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()):
        """A ``grpc.aio`` channel to ``address`` as :meth:`channel` opens one (mutual TLS
        when required, the token on every call). Open it on the event loop that uses it."""
        options, credentials = self._dial(options)
        interceptors = _aio_token(self.token) if self.token else None
        if credentials is not None:
            return grpc.aio.secure_channel(
                address, credentials, options=options, interceptors=interceptors
            )
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


_AIO_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each channel :meth:`SiteSecurity.channel` made -> how to open its grpc.aio twin."""


def aio_twin(channel: grpc.Channel) -> Callable[[], grpc.aio.Channel] | None:
    """How to open, on an event loop, a ``grpc.aio`` channel like ``channel`` (same
    address, options, TLS and token), when :meth:`SiteSecurity.channel` made it (as
    ``inter/control/channels.peer_channel`` does); None for any other channel.

    A host agent (inter/control/host_agent.py) is handed its launcher's channel and
    calls its coordinator from an event loop: on the twin its calls wait on no thread.
    """
    return _AIO_TWINS.get(channel)


INSECURE = SiteSecurity()
"""Everything off: plaintext ports and channels, no token (the default everywhere)."""


# -- server side ----------------------------------------------------------------------


def refuse_unless_named(
    security: SiteSecurity, context: grpc.ServicerContext, where: str, claimed: str, method: str
) -> None:
    """With mutual TLS, a caller may speak only for a site its certificate names
    (`isthmus certs` puts the site's name in it): another job-CA certificate cannot claim
    to be a site it is not. Refused with PERMISSION_DENIED, logged with the peer's
    address. Without TLS nothing binds a caller to a name, and nothing is checked."""
    if not security.require_tls:
        return
    names = context.auth_context().get("x509_subject_alternative_name", [])
    if claimed in {n.decode("utf-8", "replace") for n in names}:
        return
    why = f"its certificate does not name site {claimed[:64]!r}"
    log.warning("%s refused %s from %s: %s", where, method, context.peer(), why)
    context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{where}: {why}")


class _Gate(grpc.ServerInterceptor):
    """Checks every call before its handler runs; refuses with UNAUTHENTICATED."""

    def __init__(self, security: SiteSecurity, refusals: RefusalLog) -> None:
        self._security = security
        self._token = (security.token or "").encode()
        self._refusals = refusals

    def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        need_token = self._security.require_token and not method.startswith(HEALTH_PREFIX)
        return _wrap(handler, lambda context: self._check(context, method, need_token))

    def _check(self, context: grpc.ServicerContext, method: str, need_token: bool) -> None:
        why = None
        if self._security.require_tls:
            auth = context.auth_context()
            if auth.get("transport_security_type") != [b"ssl"] or not context.peer_identities():
                why = "no TLS client certificate"
        if why is None and need_token:
            sent = dict(context.invocation_metadata()).get(TOKEN_HEADER)
            if sent is None:
                why = "no job token"
            elif not hmac.compare_digest(str(sent).encode(), self._token):
                why = "wrong job token"
        if why is None:
            return
        self._refusals.note(context.peer(), f"call refused ({why})", method)
        where = self._refusals.where
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{where} refused the call: {why}")


def _wrap(handler: grpc.RpcMethodHandler, check: Callable) -> grpc.RpcMethodHandler:
    """The same handler with ``check(context)`` run first (it aborts on a refusal)."""
    inner, make = handler_parts(handler)

    def behaviour(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        check(context)  # raises on refusal: the handler never sees the request
        return inner(request_or_iterator, context)

    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# -- client side ----------------------------------------------------------------------


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _TokenAttacher(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the job token to the metadata of every call on a channel."""

    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_HEADER, token)

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        d = details
        return _CallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _AioToken:
    """:class:`_TokenAttacher` for a grpc.aio channel (a host agent's calls: unary ones
    and its vote streams). grpc.aio files an interceptor under the first kind of call it
    intercepts, so each kind is an interceptor of its own (:func:`_aio_token`)."""

    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_HEADER, token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        d = details
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready
        )


class _AioUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioStreamToken(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def _aio_token(token: str) -> list:
    return [_AioUnaryToken(token), _AioStreamToken(token)]
