""":class:`FaultProxy`: a small HTTP proxy on 127.0.0.1 in front of a local object store that
injects faults (errors, resets, stalls) into chosen requests.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import servers


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 that forwards to ``upstream`` unless ``rule`` says otherwise.

    ``rule(method, path, headers, seen)`` returns None (forward), an HTTP status (answer with
    it), ``"reset"`` (drop the connection with a TCP reset) or ``("stall", seconds)`` (say
    nothing for that long, then reset). ``seen`` counts earlier requests with the same method,
    path and Range header, so "fail the first attempt" rules are deterministic.
    """

    def __init__(self, upstream: str, rule: Callable[..., Any]) -> None:
        self.upstream = urllib.parse.urlparse(upstream)
        self.rule = rule
        self.seen: dict[tuple[str, str, str], int] = {}
        self.log: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        data += self.rfile.read(size)
                        self.rfile.readline()
                        if size == 0:
                            return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reset(self) -> None:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            def _handle(self) -> None:
                body = self._body()
                key = (self.command, self.path, self.headers.get("Range", ""))
                with proxy._lock:
                    seen = proxy.seen.get(key, 0)
                    proxy.seen[key] = seen + 1
                action = proxy.rule(
                    self.command, urllib.parse.unquote(self.path), self.headers, seen
                )
                with proxy._lock:
                    proxy.log.append((self.command, self.path, action))
                if isinstance(action, tuple) and action[0] == "stall":
                    time.sleep(action[1])
                    action = "reset"
                if action == "reset":
                    return self._reset()
                if isinstance(action, int):
                    payload = (
                        b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                        if "/storage/v1/" not in self.path
                        else json.dumps({"error": {"code": action, "message": "injected"}}).encode()
                    )
                    self.send_response(action)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return None
                try:
                    conn = http.client.HTTPConnection(
                        proxy.upstream.hostname, proxy.upstream.port, timeout=60
                    )
                    headers = {
                        k: v
                        for k, v in self.headers.items()
                        if k.lower() not in ("connection", "transfer-encoding", "content-length")
                    }
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    conn.close()
                except OSError:  # the server is gone: the client sees a dropped connection
                    return self._reset()
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # (a HEAD response has no body: its Content-Length is the object's, as sent)
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # clients that gave up (timeouts) or connections we reset on purpose

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def through_proxy(
    server: servers.ObjectStoreServer, rule: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> Iterator[FaultProxy]:
    """Points this library's object-storage clients (not fsspec/Orbax) at a FaultProxy."""
    proxy = FaultProxy(server.endpoint_url, rule)
    try:
        with monkeypatch.context() as m:
            if server.kind == "s3":
                m.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
                m.setenv("AWS_ENDPOINT_URL", proxy.url)
            else:
                m.setenv("STORAGE_EMULATOR_HOST", proxy.url)
            yield proxy
    finally:
        proxy.close()
