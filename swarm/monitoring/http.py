"""The bootstrap's HTTP server on --metrics-port: Prometheus metrics at /metrics, the status page at / and its
data at /api/swarm, served from daemon threads so a slow client never blocks the DHT loop."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from swarm.monitoring.status_page import render_page, to_json_bytes

logger = logging.getLogger(__name__)
# The page needs nothing from elsewhere: inline script and style, data from this server only. Saying so in the
# header keeps a peer's announced strings from pulling anything in even if one slipped past the page's escaping.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")


class MonitoringServer:
    """Serves `registry` at /metrics and `payload()` (a JSON-ready dict) at /api/swarm and as the page at /.
    Binds at construction (port 0 picks a free port, see `.port`); `close()` stops it."""

    def __init__(self, registry: CollectorRegistry, payload: Callable[[], dict], host: str = "127.0.0.1",
                 port: int = 0):
        handler = type("Handler", (_Handler,), {"registry": registry, "payload": staticmethod(payload)})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="swarm-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    payload: Callable[[], dict]
    server_version = "swarm-bootstrap"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        try:
            response = self._response(urlsplit(self.path).path)
        except Exception:  # noqa: BLE001 - one bad request must not take the server down; log it, answer 500
            logger.exception("error serving %s", self.path)
            response = 500, "text/plain; charset=utf-8", b"internal error\n", {}
        try:
            self._send(*response, head_only=self.command == "HEAD")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left (a closed browser tab): nothing to answer

    do_HEAD = do_GET  # noqa: N815

    def _response(self, path: str) -> tuple[int, str, bytes, dict[str, str]]:
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            return 200, content_type, encoder(self.registry), {}
        if path in ("/", "/index.html"):
            return (200, "text/html; charset=utf-8", render_page(self.payload()),
                    {"Content-Security-Policy": CONTENT_SECURITY_POLICY})
        if path == "/api/swarm":
            return 200, "application/json", to_json_bytes(self.payload()), {}
        return 404, "text/plain; charset=utf-8", b"not found: try /, /api/swarm or /metrics\n", {}

    def _send(self, status: int, content_type: str, body: bytes, headers: dict[str, str], head_only: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        logger.debug("%s %s", self.address_string(), format % args)
