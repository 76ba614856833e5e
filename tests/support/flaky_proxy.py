"""An HTTP proxy on loopback that can be told to answer 503 for a while.

Put in front of the S3 server (moto) to give the chaos run "the S3 server answering 5xx for a
while": the blob store sees real HTTP errors through botocore, exactly as from a sick S3.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
from urllib.parse import urlparse

_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected fault</Message></Error>"
)


class FlakyProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        target = urlparse(upstream)
        self._failing_until = 0.0
        self._lock = threading.Lock()
        self.failed_requests = 0  # answered 503 (each request has a thread of its own)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if time.monotonic() < proxy._failing_until:
                    with proxy._lock:
                        proxy.failed_requests += 1
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_ERROR)))
                    self.end_headers()
                    self.wfile.write(_ERROR)
                    return
                upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    headers["Host"] = target.netloc
                    upstream_conn.request(self.command, self.path, body=body, headers=headers)
                    response = upstream_conn.getresponse()
                    payload = response.read()
                finally:
                    upstream_conn.close()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

            def log_message(self, *_: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                # A client killed mid-request (the chaos run SIGKILLs worker children) resets
                # its connection: expected here, not worth a traceback.
                pass

        self._server = Server((host, port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FlakyProxy:
        self._thread.start()
        return self

    def fail_for(self, seconds: float) -> None:
        """Answer every request with 503 for the next `seconds`."""
        self._failing_until = time.monotonic() + seconds

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
