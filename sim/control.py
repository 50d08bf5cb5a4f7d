"""The relay's control endpoint: HTTP/JSON on loopback, to read and change live links.

    GET  /links               {name: {"spec": ..., "stats": ..., "listeners": [...]}}, and
                              "trace": {direction: {"row": ..., "next_s": ...}} if traced
    GET  /links/NAME          one link, same shape
    POST /links/NAME          body: topology-file keys, e.g. {"bandwidth_mbit": 50} or
                              {"a_to_b": {"impairments": [{"kind": "loss", "rate": 0.01}]}};
                              applied at once to bytes sent afterwards; answers the link
    POST /links/NAME/reset    reset every connection on the link (RST both sides)

Errors answer 400 (a bad key or value: nothing changed) or 404 (no such link) with
{"error": "one line"}. `control_request` is the client `isthmus wan` uses."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from .connect import is_loopback
from .topology import apply_changes, spec_to_table

if TYPE_CHECKING:
    from .relay import Link, RelayServer

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 10.0
DEFAULT_ADDRESS = "127.0.0.1:7407"
"""Where `isthmus wan up` and `wan netns up` serve, and `wan show/set` ask, by default."""


def parse_address(text: str, flag: str = "--control") -> tuple[str, int]:
    """``HOST:PORT`` on loopback (port 0: any free one); ValueError naming ``flag``."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag} expects HOST:PORT, got {text!r}")
    if not is_loopback(host):
        raise ValueError(f"{flag} {text!r}: only loopback addresses are allowed")
    return host, int(port)


def describe(link: Link) -> dict[str, Any]:
    """A link as the control endpoint shows it: spec tables, counters, listeners, and
    where its traces are (`Replay.position`), if it has any."""
    out = {"spec": spec_to_table(link.spec), "stats": link.stats(), "listeners": link.listeners}
    return out if link.replay is None else {**out, "trace": link.replay.position()}


class ControlServer:
    """Serves the control endpoint of a `RelayServer` on a daemon thread, on a loopback
    `host` (anyone who reaches it can change the links)."""

    def __init__(self, relay: RelayServer, host: str = "127.0.0.1", port: int = 0) -> None:
        if not is_loopback(host):
            raise ValueError(f"the control endpoint listens on loopback only, got host {host!r}")
        handler = type("Handler", (_Handler,), {"relay": relay})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="isthmus-wan-control", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        """ "host:port" the endpoint listens on."""
        host, port = self._httpd.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address: (str, int)
        return f"{host}:{port}"

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(REQUEST_TIMEOUT_S)
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    relay: RelayServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass  # the CLI prints what matters; no access log on stderr

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _link(self, name: str) -> Link | None:
        link = self.relay.links().get(name)
        if link is None:
            known = ", ".join(self.relay.links()) or "none"
            self._answer(404, {"error": f"no link named {name!r}; links: {known}"})
        return link

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        parts = self.path.strip("/").split("/")
        if parts == ["links"]:
            self._answer(200, {n: describe(link) for n, link in self.relay.links().items()})
        elif len(parts) == 2 and parts[0] == "links":
            link = self._link(parts[1])
            if link is not None:
                self._answer(200, describe(link))
        else:
            self._answer(404, {"error": f"no such path {self.path!r}; try GET /links"})

    def do_POST(self) -> None:  # noqa: N802
        parts = self.path.strip("/").split("/")
        if len(parts) not in (2, 3) or parts[0] != "links" or parts[2:] not in ([], ["reset"]):
            self._answer(404, {"error": f"no such path {self.path!r}; try POST /links/NAME"})
            return
        link = self._link(parts[1])
        if link is None:
            return
        if parts[2:] == ["reset"]:
            link.reset()
            self._answer(200, describe(link))
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY_BYTES:
                raise ValueError(f"the body must be a JSON object of 1..{MAX_BODY_BYTES} bytes")
            changes = json.loads(self.rfile.read(length))
            if not isinstance(changes, dict) or not changes:
                raise ValueError(f"the body must be a non-empty JSON object, got {changes!r}")
            with link.lock:  # a trace's row may not come between reading and changing
                link.update(apply_changes(link.spec, changes, f"links.{link.name}"))
        except ValueError as exc:  # json.JSONDecodeError is one too
            self._answer(400, {"error": str(exc)})
            return
        self._answer(200, describe(link))


def control_request(
    address: str, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    """Call a control endpoint ("host:port") and return its JSON answer; ValueError with
    its one-line reason when it refused the request, OSError when nothing answers."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a control address is HOST:PORT, got {address!r}")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        answer = json.loads(response.read() or b"null")
    finally:
        conn.close()
    if response.status != 200:
        raise ValueError(answer.get("error") if isinstance(answer, dict) else str(answer))
    return answer
