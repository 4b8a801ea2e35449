"""An HTTP proxy in front of a real S3 server that fails requests on cue, for the storage-fault tests.

Faults are queued per request (``fail("503", times=2, method="PUT")``): a 503 SlowDown (throttling),
a 500 InternalError, or a dropped connection (closed without a reply). ``down()`` closes the listening
socket, so the endpoint refuses connections like a dead server, until ``up()``. Every request and its
outcome is recorded with a timestamp, so tests can count attempts and show the backoff between them.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """Connections cut by ``down()`` break mid-reply on purpose: nothing to report."""


class ChaosProxy:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream).netloc
        self.faults: list[dict] = []
        self.log: list[tuple[float, str, str, str]] = []  # (time, method, path, outcome)
        self.lock = threading.Lock()
        self.port = 0
        self.server = None
        self.connections: set[socket.socket] = set()
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail(self, fault: str, times: int = 1, method: str | None = None, path: str = "") -> None:
        """Answer the next ``times`` requests matching ``method`` and a path containing ``path`` with ``fault``
        ("503", "500", "drop"); "down-after" instead takes the whole endpoint down after forwarding them."""
        with self.lock:
            self.faults.append({"fault": fault, "left": times, "method": method, "path": path})

    def attempts(self, method: str, path: str) -> list[tuple[float, str]]:
        """``(time, outcome)`` of every request ``method`` whose path contains ``path``."""
        return [(t, outcome) for t, m, p, outcome in self.log if m == method and path in p]

    def up(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                proxy.connections.add(self.connection)

            def finish(self):
                proxy.connections.discard(self.connection)
                super().finish()

            def _handle(self):
                body = self._body()
                fault = proxy._take(self.command, self.path)
                proxy.log.append((time.monotonic(), self.command, self.path, fault or "forwarded"))
                if fault == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if fault in _ERRORS:
                    status, code, message = _ERRORS[fault]
                    reply = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                             f"<Message>{message}</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                self._forward(body)
                if fault == "down-after":
                    proxy.down()

            def _body(self) -> bytes:
                """The request body, de-chunked when the client streamed it (boto3's upload_file does)."""
                if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                    return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(chunks)

            def _forward(self, body: bytes):
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in _HOP_BY_HOP | {"content-length"}:
                        self.send_header(key, value)
                self.send_header("Content-Length", reply.getheader("Content-Length", str(len(data))))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = _Server(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut open connections: the endpoint refuses connections until ``up()`` (same port)."""
        with self.lock:
            server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        for conn in list(self.connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _take(self, method: str, path: str) -> str | None:
        with self.lock:
            for fault in self.faults:
                if fault["left"] and fault["method"] in (None, method) and fault["path"] in path:
                    fault["left"] -= 1
                    return fault["fault"]
        return None
