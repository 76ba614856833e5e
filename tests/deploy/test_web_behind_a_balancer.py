"""The console behind a load balancer: uvicorn, as `mailpipe web` starts it, takes the client's
address from X-Forwarded-For when the peer is a balancer the web task's FORWARDED_ALLOW_IPS
names, so that the sign-in's per-address limit (mailpipe/web/auth.py) counts each client, not
the balancer. Offline: the server is not started, its app is called as it would call it."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import anyio
import pytest
import uvicorn
from starlette.types import Message, Scope

from mailpipe.settings import Settings
from mailpipe.web import server
from tests.support.paths import REPO

BALANCER = "10.0.0.7"  # a node of the load balancer, in one of its subnets
CLIENT = "203.0.113.9"


def web_task_allows() -> str:
    definition = json.loads((REPO / "deploy" / "ecs" / "web.json").read_text())
    (web,) = definition["containerDefinitions"]
    return {e["name"]: e["value"] for e in web["environment"]}["FORWARDED_ALLOW_IPS"]


def test_the_web_task_trusts_the_balancer_s_subnets_and_no_one_else() -> None:
    allowed = web_task_allows()
    # With "*" uvicorn takes the leftmost address, which the client writes itself.
    assert "*" not in allowed
    networks = [ipaddress.ip_network(entry.strip()) for entry in allowed.split(",")]
    assert any(ipaddress.ip_address(BALANCER) in network for network in networks)
    assert not any(ipaddress.ip_address(CLIENT) in network for network in networks)


@pytest.mark.parametrize(
    ("peer", "forwarded", "seen"),
    [
        # The balancer appends the address it was reached from to what the client sent.
        (BALANCER, f"6.6.6.6, {CLIENT}", CLIENT),
        (BALANCER, CLIENT, CLIENT),
        # Anyone else's header is their own word, and ignored.
        (CLIENT, "6.6.6.6", CLIENT),
    ],
)
def test_mailpipe_web_sees_the_client_the_balancer_names(
    peer: str, forwarded: str, seen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", web_task_allows())
    started: dict[str, Any] = {}
    monkeypatch.setattr(server, "_log_to_stderr", lambda settings: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: started.update(options, app=app))
    server.serve(Settings())
    clients: list[Any] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        clients.append(scope["client"])

    # The server `mailpipe web` starts, with what it is given, around an app that notes the
    # client it is handed.
    options = {key: value for key, value in started.items() if key != "app"}
    config = uvicorn.Config(app, **options)
    config.load()
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "method": "GET",
        "path": "/",
        "headers": [(b"x-forwarded-for", forwarded.encode())],
        "client": (peer, 40000),
    }

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        pass

    anyio.run(config.loaded_app, scope, receive, send)
    assert clients[0][0] == seen
