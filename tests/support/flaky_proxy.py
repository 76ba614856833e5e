"""An HTTP proxy on loopback that can be told to answer 503 for a while, or 403 until told not to.

Put in front of the S3 server (moto): `fail_for` gives the chaos run "the S3 server answering 5xx
for a while", `deny` an S3 that refuses the fleet's credentials (AccessDenied, or another code)
until the test restores them, `deny_keys` a bucket that refuses a few objects (a KMS key the role
lacks, a deny on objects a malware scan tagged), `deny_writes` one that refuses PutObject under
a prefix. The blob store sees real HTTP errors through botocore, exactly as from a sick or
misconfigured S3.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
from urllib.parse import urlparse


def _s3_error_body(code: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        "<Message>injected fault</Message></Error>"
    ).encode()


class FlakyProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        target = urlparse(upstream)
        self._failing_until = 0.0
        self._denied_with: str | None = None  # the S3 error code of a 403, while denying
        self._denied_keys: frozenset[str] = frozenset()
        self._denied_writes: str | None = None  # a key prefix
        self._lock = threading.Lock()
        # The paths of the requests answered with an injected error (a thread per request), and
        # of every request.
        self.failed_paths: list[str] = []
        self.paths: list[str] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                injected = proxy._injected_error(self.command, self.path)
                if injected is not None:
                    status, error = injected
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
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

    def deny(self, on: bool = True, code: str = "AccessDenied") -> None:
        """From now on answer every request with 403 and S3's error `code`, until `deny(False)`."""
        self._denied_with = code if on else None

    def deny_keys(self, keys: frozenset[str] | set[str]) -> None:
        """Answer 403 AccessDenied to every request for an object whose key ends one of `keys`."""
        self._denied_keys = frozenset(keys)

    def deny_writes(self, prefix: str | None) -> None:
        """Answer 403 AccessDenied to every PUT of a key under `prefix` (None: allow them)."""
        self._denied_writes = prefix

    def requests_to(self, fragment: str) -> int:
        """Requests so far whose path holds `fragment`."""
        with self._lock:
            return sum(fragment in path for path in self.paths)

    @property
    def failed_requests(self) -> int:
        return len(self.failed_paths)

    def _injected_error(self, method: str, path: str) -> tuple[int, bytes] | None:
        with self._lock:
            self.paths.append(path)
        key_path = path.split("?", 1)[0]
        denied_with = self._denied_with
        writes = self._denied_writes
        if denied_with is not None:
            answer = (403, _s3_error_body(denied_with))
        elif any(key_path.endswith(key) for key in self._denied_keys) or (
            writes is not None and method == "PUT" and f"/{writes}" in key_path
        ):
            answer = (403, _s3_error_body("AccessDenied"))
        elif time.monotonic() < self._failing_until:
            answer = (503, _s3_error_body("ServiceUnavailable"))
        else:
            return None
        with self._lock:
            self.failed_paths.append(path)
        return answer

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
