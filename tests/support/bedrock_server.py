"""A local stand-in for Amazon Bedrock's `converse` API, spoken over HTTP to real botocore.

It answers `POST /model/{modelId}/converse` in the rest-json wire format closely enough for
botocore to parse successes and modelled errors (header `x-amzn-ErrorType`, JSON `message`).
It does not check signatures, so any fake credentials do.

Behaviour is scripted per test: `enqueue` responders (`labels`, `text`, `error`, `throttling`),
each answering one request in order; once the queue is empty, `default` answers (by default
`keyword_labels`, which picks labels by keywords so that whole benchmark runs can be served).
`delay` seconds are spent before every answer, as a model would. Every request is recorded.

In tests::

    with BedrockServer() as server:
        server.enqueue(throttling(), labels({"invoice": 0.9}))
        ...  # point boto3 at server.url
        assert len(server.requests) == 2

From a shell (prints the URL, serves until SIGINT or SIGTERM)::

    python -m tests.support.bedrock_server --port 0 --delay 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import signal
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import unquote

from tests.support.emails import raw_email

log = logging.getLogger(__name__)

_CONVERSE_PATH = re.compile(r"^/model/(?P<model_id>[^/]+)/converse$")
# The opening of a fence around the email's text in the prompt, with its random nonce
# (mailpipe.classifiers.prompt.build_prompt).
_FENCE_NONCE = re.compile(r"<<<EMAIL_DATA (?P<nonce>[0-9a-f]+)\n")
# Bedrock appends a namespace to the error type; botocore keeps the part before the colon.
_ERROR_NAMESPACE = "http://internal.amazon.com/coral/com.amazon.bedrock/"

# Keywords for the default label set (mailpipe.settings.DEFAULT_LABELS); any other label is
# matched by its own name.
KEYWORDS: Mapping[str, tuple[str, ...]] = {
    "invoice": ("invoice", "amount due", "payment", "receipt"),
    "newsletter": ("newsletter", "unsubscribe", "weekly digest"),
    "security": ("password", "sign-in", "security alert", "verify your"),
    "bounce": ("undeliverable", "delivery status notification", "mailer-daemon"),
    "spam": ("lottery", "winner", "viagra", "crypto giveaway"),
    "personal": ("dinner", "birthday", "family"),
    "support": ("ticket", "support request", "help desk"),
    "calendar": ("invitation:", "meeting", "calendar"),
}


@dataclass(frozen=True)
class ConverseRequest:
    """One request as received: the model id from the path and the JSON body."""

    model_id: str
    body: dict[str, Any]
    headers: Mapping[str, str]

    @property
    def system_text(self) -> str:
        return "\n".join(block.get("text", "") for block in self.body.get("system", []))

    @property
    def user_text(self) -> str:
        return "\n".join(
            block.get("text", "")
            for message in self.body.get("messages", [])
            if message.get("role") == "user"
            for block in message.get("content", [])
        )

    @property
    def tool_name(self) -> str:
        return self.body.get("toolConfig", {}).get("toolChoice", {}).get("tool", {}).get("name", "")

    @property
    def label_enum(self) -> list[str]:
        tools = self.body.get("toolConfig", {}).get("tools", [])
        if not tools:
            return []
        schema = tools[0]["toolSpec"]["inputSchema"]["json"]
        return schema["properties"]["labels"]["items"]["properties"]["label"]["enum"]


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


Responder = Callable[[ConverseRequest], Reply]


def labels(scores: Mapping[str, float], *, tool_name: str | None = None) -> Responder:
    """A tool-use answer with these labels; the tool name is the request's unless given."""

    def respond(request: ConverseRequest) -> Reply:
        tool_input = {"labels": [{"label": k, "confidence": v} for k, v in scores.items()]}
        block = {
            "toolUse": {
                "toolUseId": _id(),
                "name": tool_name or request.tool_name,
                "input": tool_input,
            }
        }
        return _success(request, [block], stop_reason="tool_use")

    return respond


def text(message: str) -> Responder:
    """A plain text answer with no tool use: what a model that ignored the tool says."""

    def respond(request: ConverseRequest) -> Reply:
        return _success(request, [{"text": message}], stop_reason="end_turn")

    return respond


def error(
    error_type: str, status: int, message: str, *, headers: Mapping[str, str] | None = None
) -> Responder:
    """An error response as Bedrock sends it."""

    def respond(request: ConverseRequest) -> Reply:
        return Reply(
            status,
            {"message": message},
            {"x-amzn-ErrorType": f"{error_type}:{_ERROR_NAMESPACE}", **(headers or {})},
        )

    return respond


def throttling(*, retry_after_ms: int | None = None) -> Responder:
    """HTTP 429 ThrottlingException, optionally with the `x-amz-retry-after` header (ms)."""
    headers = {} if retry_after_ms is None else {"x-amz-retry-after": str(retry_after_ms)}
    return error(
        "ThrottlingException",
        429,
        "Too many requests, please wait before trying again.",
        headers=headers,
    )


def keyword_labels(request: ConverseRequest) -> Reply:
    """Labels of the request's label set whose keywords occur in its user text."""
    haystack = request.user_text.lower()
    found = {
        label: 0.9
        for label in request.label_enum
        if any(word in haystack for word in KEYWORDS.get(label, (label,)))
    }
    return labels(found)(request)


def _success(request: ConverseRequest, content: list[dict[str, Any]], *, stop_reason: str) -> Reply:
    # About four characters a token, as for English text; enough for tests to see numbers move.
    input_tokens = (len(request.system_text) + len(request.user_text)) // 4
    output_tokens = 5 + len(json.dumps(content)) // 4
    return Reply(
        200,
        {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": stop_reason,
            "usage": {
                "inputTokens": input_tokens,
                "outputTokens": output_tokens,
                "totalTokens": input_tokens + output_tokens,
            },
            "metrics": {"latencyMs": 0},  # the handler fills in the time actually taken
        },
    )


def _id() -> str:
    return f"tooluse_{uuid.uuid4().hex[:22]}"


class LoopbackServer:
    """An HTTP server on loopback, served from a thread of its own; a subclass sets `_httpd`."""

    _httpd: ThreadingHTTPServer
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        # A short poll interval keeps `stop` quick (it waits for the serving loop's next poll).
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=type(self).__name__,
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class BedrockServer(LoopbackServer):
    """The server and its script. Thread-safe: botocore may call it from many threads."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        delay: float = 0.0,
        default: Responder = keyword_labels,
    ) -> None:
        self.delay = delay
        self.default = default
        self._script = (delay, default)
        self._lock = threading.Lock()
        self._queue: deque[Responder] = deque()
        self._requests: list[ConverseRequest] = []
        self._httpd = _Server((host, port), _Handler)
        self._httpd.bedrock = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def requests(self) -> list[ConverseRequest]:
        """The requests received so far, oldest first (a copy)."""
        with self._lock:
            return list(self._requests)

    def enqueue(self, *responders: Responder) -> None:
        """Answer the next requests with these, in order."""
        with self._lock:
            self._queue.extend(responders)

    def reset(self) -> None:
        """Back to the script it started with: no answers queued, no requests recorded."""
        with self._lock:
            self._queue.clear()
            self._requests.clear()
            self.delay, self.default = self._script

    def record(self, request: ConverseRequest) -> None:
        """Keep `request` (called under the server's lock)."""
        self._requests.append(request)

    def answer(self, request: ConverseRequest) -> Reply:
        """Record `request` and answer it with the next queued responder or the default."""
        with self._lock:
            self.record(request)
            responder = self._queue.popleft() if self._queue else self.default
        started = time.monotonic()
        time.sleep(self.delay)
        reply = responder(request)
        if "metrics" in reply.body:
            reply.body["metrics"]["latencyMs"] = round((time.monotonic() - started) * 1000)
        return reply


class _Server(ThreadingHTTPServer):
    # The model role opens a connection per thread (32) at once: socketserver's listen backlog
    # of 5 would drop some on a loaded machine, which botocore reports as an outage.
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed while it waited for its answer (the chaos run SIGKILLs worker
        # children) resets its connection: expected, not worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps botocore's pooled connections alive, as the real endpoint does.
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, each answer on a kept-alive
    # connection waits ~40 ms for the client's delayed ACK.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        match = _CONVERSE_PATH.match(self.path)
        if match is None:
            self._send(
                Reply(
                    404,
                    {"message": f"no such operation: {self.path}"},
                    {"x-amzn-ErrorType": "UnknownOperationException"},
                )
            )
            return
        try:
            payload = json.loads(body)
        except ValueError:
            self._send(
                Reply(
                    400,
                    {"message": "request body is not JSON"},
                    {"x-amzn-ErrorType": "SerializationException"},
                )
            )
            return
        request = ConverseRequest(unquote(match["model_id"]), payload, dict(self.headers))
        self._send(self.server.bedrock.answer(request))  # type: ignore[attr-defined]

    def _send(self, reply: Reply) -> None:
        data = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up first (a read timeout under test): nobody is left to answer.
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


@dataclass(frozen=True)
class Call:
    arrived: float  # time.monotonic() of this (the test) process
    answered: float
    status: int
    user_text: str = ""  # what the call asked about, to tell the tests' emails apart


class TimedBedrockServer(BedrockServer):
    """The local Bedrock server, also recording when each call arrived and was answered, and the
    most calls it held at once. `BedrockServer` records the requests but not their times."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._timing = threading.Lock()
        self._in_flight = 0
        self.peak_in_flight = 0
        self.calls: list[Call] = []

    def answer(self, request: ConverseRequest) -> Reply:
        with self._timing:
            arrived = time.monotonic()
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        try:
            reply = super().answer(request)
        finally:
            with self._timing:
                self._in_flight -= 1
        with self._timing:
            self.calls.append(Call(arrived, time.monotonic(), reply.status, request.user_text))
        return reply

    def arrivals(self) -> list[float]:
        with self._timing:
            return sorted(call.arrived for call in self.calls)

    def arrivals_about(self, text: str) -> list[float]:
        """The arrivals of the calls whose prompt holds `text`."""
        with self._timing:
            return sorted(call.arrived for call in self.calls if text in call.user_text)

    def statuses(self) -> list[int]:
        """The answers' HTTP statuses, in the order the calls arrived."""
        with self._timing:
            return [call.status for call in sorted(self.calls, key=lambda call: call.arrived)]


def email_key(user_text: str) -> str:
    """Which email a prompt is about: a digest of its user text without the fences' random nonce,
    the same for every call about one email (the model's input is kept between the stages)."""
    match = _FENCE_NONCE.search(user_text)
    if match is not None:
        user_text = user_text.replace(match["nonce"], "")
    return hashlib.sha256(user_text.encode()).hexdigest()


class CountingBedrockServer(BedrockServer):
    """The local Bedrock server, counting the calls per email (`email_key`) instead of keeping
    each request, so that a run of thousands of calls holds a counter per email, not every
    prompt. `requests` stays empty."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._calls: Counter[str] = Counter()

    @property
    def calls(self) -> Counter[str]:
        """Calls received so far per `email_key` (a copy)."""
        with self._lock:
            return Counter(self._calls)

    def record(self, request: ConverseRequest) -> None:
        self._calls[email_key(request.user_text)] += 1


def bedrock_env(server: BedrockServer, aws_dir: Path) -> dict[str, str]:
    """The settings of a worker whose `bedrock` backend calls `server`, and nothing from the
    developer's own AWS set-up (the fake credentials are in the test environment)."""
    return {
        "MAILPIPE_MODEL_BACKEND": "bedrock",
        "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": server.url,
        "AWS_CONFIG_FILE": str(aws_dir / "missing"),
        "AWS_SHARED_CREDENTIALS_FILE": str(aws_dir / "missing"),
    }


def unlimited_bedrock_env(server: BedrockServer, aws_dir: Path) -> dict[str, str]:
    """`bedrock_env` with a fleet rate limit no test reaches."""
    return {
        **bedrock_env(server, aws_dir),
        "MAILPIPE_MODEL_RATE_PER_S": "100",
        "MAILPIPE_MODEL_BURST": "100",
    }


def invoices(n: int, subject: str = "Invoice") -> list[bytes]:
    tag = uuid.uuid4().hex[:8]
    return [
        raw_email(
            f"{subject} {i}",
            sender="billing@example.org",
            to="a@example.org",
            message_id=f"{tag}.{i}@example.org",
            body=f"Amount due: {i} EUR.",
        )
        for i in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    args = parser.parse_args()

    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    with BedrockServer(args.host, args.port, delay=args.delay) as server:
        print(server.url, flush=True)
        stopping.wait()
        print(f"served {len(server.requests)} requests", flush=True)


if __name__ == "__main__":
    main()
