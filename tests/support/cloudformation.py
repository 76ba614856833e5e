"""A template's Lambda-backed custom resource run as CloudFormation runs it: its inline function
exec'd, on an event of the resource's properties resolved as CloudFormation resolves them, its
answer taken by a local stand-in for the presigned S3 URL CloudFormation hands it."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

STACK_ID = "arn:aws:cloudformation:us-east-1:123456789012:stack/mailpipe/1"


@dataclass
class Responses:
    """Where the function answers: `url`, and each answer as (method, headers, body)."""

    url: str
    answers: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)


@contextmanager
def responses() -> Iterator[Responses]:
    """A loopback server that takes the function's answers, one PUT each."""
    taken = Responses("")

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            taken.answers.append((self.command, dict(self.headers), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    taken.url = f"http://127.0.0.1:{server.server_port}/stack-events?X-Amz-Signature=x"
    try:
        yield taken
    finally:
        server.shutdown()
        server.server_close()


def resolved(value: Any, parameters: dict[str, Any]) -> Any:
    """A custom resource's property as its function receives it: `Ref` and `Fn::Sub` of
    parameters resolved, and every scalar a string."""
    if isinstance(value, dict):
        if set(value) == {"Ref"}:
            return str(parameters[value["Ref"]])
        if set(value) == {"Fn::Sub"}:
            return re.sub(r"\$\{(\w+)\}", lambda m: str(parameters[m[1]]), value["Fn::Sub"])
        return {k: resolved(v, parameters) for k, v in value.items()}
    if isinstance(value, list):
        return [resolved(v, parameters) for v in value]
    return str(value)


def function_of(template: dict[str, Any], name: str) -> dict[str, Any]:
    """The namespace of the inline code of the template's function `name`."""
    code = template["Resources"][name]["Properties"]["Code"]["ZipFile"]
    namespace: dict[str, Any] = {}
    exec(compile(code, "index.py", "exec"), namespace)
    return namespace


def invoke(
    template: dict[str, Any],
    function: dict[str, Any],
    resource: str,
    taken: Responses,
    request_type: str,
    parameters: dict[str, Any],
    physical_id: str | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Run `function`'s handler for the template's `resource` on an event of `request_type`,
    with the template's parameter defaults and `parameters`; the one answer it made (headers,
    body)."""
    defaults = {name: p.get("Default") for name, p in template["Parameters"].items()}
    properties = dict(template["Resources"][resource]["Properties"])
    del properties["ServiceToken"]  # the function's ARN, resolved by CloudFormation
    event = {
        "RequestType": request_type,
        "ResponseURL": taken.url,
        "StackId": STACK_ID,
        "RequestId": "request-1",
        "ResourceType": template["Resources"][resource]["Type"],
        "LogicalResourceId": resource,
        "ResourceProperties": resolved(properties, defaults | parameters),
    }
    if request_type != "Create":
        event["PhysicalResourceId"] = physical_id or resource
    taken.answers.clear()
    function["handler"](event, None)
    [(method, headers, body)] = taken.answers
    assert method == "PUT"
    return headers, body
