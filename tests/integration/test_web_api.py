"""The console's write API on a real `mailpipe web`: JSON in and out, an operator's actions
through the same room as the forms and the CLI, a viewer refused, any body but JSON refused, a
body too long or too deep refused, and every error of the API answered in JSON."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from base64 import b64encode

import pytest
import requests
import yaml

from mailpipe.broker.queues import Stage
from mailpipe.cli.demo.servers import free_port
from mailpipe.coordination import pauses
from mailpipe.storage import flags
from tests.integration.test_web import console, failed_run, run_status  # noqa: F401 (fixture)
from tests.support.console import OPERATOR, VIEWER, ConsoleProcess
from tests.support.switches import set_model_calls

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def test_an_operator_acts_through_the_api_and_a_viewer_is_refused(res, console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    failed = failed_run(res)
    web = console()
    api = f"{web.url}/api"

    def post(path: str, body: object, auth: tuple[str, str] = OPERATOR) -> requests.Response:
        return requests.post(f"{api}{path}", json=body, auth=auth, timeout=10)

    listed = requests.get(f"{api}/failed", auth=VIEWER, timeout=10).json()
    assert [row["email_id"] for row in listed["rows"]] == [failed]
    assert post(f"/emails/{failed}/retry", {}, VIEWER).status_code == 403
    as_form = requests.post(f"{api}/emails/{failed}/retry", data={}, auth=OPERATOR, timeout=10)
    assert (as_form.status_code, as_form.json()) == (
        415,
        {"error": "an action's body is JSON (Content-Type: application/json)"},
    )
    assert run_status(res, failed) == "failed"

    done = post(f"/emails/{failed}/retry", {})
    assert (done.status_code, done.json()) == (
        200,
        {"done": [failed], "enqueued": 1, "refused": {}},
    )
    assert run_status(res, failed) == "open"
    again = post(f"/emails/{failed}/retry", {}).json()
    assert again == {"done": [], "enqueued": 0, "refused": {str(failed): "its run is open"}}

    paused = post("/stages/model/pause", {"reason": "provider maintenance"})
    assert paused.json() == {"stage": "model", "paused": True, "by": "operator"}
    assert pauses.paused(res.redis)[Stage.MODEL].error == "provider maintenance"
    assert post("/stages/model/resume", {}).json()["was_paused"] is True
    assert pauses.paused(res.redis) == {}
    assert post("/stages/model/stop", {}).status_code == 404

    switched = requests.put(f"{api}/model-calls", json={"on": False}, auth=OPERATOR, timeout=10)
    assert switched.json() == {"model_calls": False}
    with res.db.session() as session:
        assert not flags.model_calls_enabled(session)
    refused = requests.put(f"{api}/model-calls", json={"on": "yes"}, auth=OPERATOR, timeout=10)
    assert refused.status_code == 400

    dry = post("/reprocess", {"label": "invoice", "from": "classify", "dry_run": True})
    assert dry.json() == {
        "emails": 0,
        "model_calls": 0,
        "reprocess_id": None,
        "enqueued": 0,
        "taken": 0,
        "as_of": 0,
        "max": 10_000,
    }
    assert post("/reprocess", {"from": "classify"}).status_code == 400  # no filter: refused
    log = web.output()
    assert "retry by api:" in log and "pause_model by api:" in log


def test_a_reprocess_takes_the_count_its_plan_gave_and_each_email_once(res, console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    """POST /api/reprocess takes emails only with its plan's count echoed (`expect`, and its
    `as_of`), else 409 with the plan as it is now; the same request sent again takes nothing;
    past MAILPIPE_REPROCESS_MAX only with `over_max`; a filter that leaves out no succeeded
    email is none."""
    from mailpipe.cli.ingest import store_emails
    from mailpipe.pipeline import job
    from tests.unit.operations.test_reprocess import OTHER
    from tests.unit.pipeline.test_job import INVOICE, PLAIN

    set_model_calls(res, True)
    ids = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    assert [job.process_email(res, i).kind.value for i in [*ids, other]] == ["succeeded"] * 3
    web = console({**os.environ, "MAILPIPE_REPROCESS_MAX": "1"})

    def post(body: object) -> requests.Response:
        return requests.post(f"{web.url}/api/reprocess", json=body, auth=OPERATOR, timeout=10)

    for everything in ({"state": "succeeded"}, {"review": "no"}, {"since": "1970-01-01"}):
        refused = post({**everything, "from": "parse", "dry_run": True})
        assert refused.status_code == 400, refused.text
        assert "every email is not a filter" in refused.json()["error"]
    asked = {"label": "invoice", "from": "parse"}
    plan = post({**asked, "dry_run": True}).json()
    assert (plan["emails"], plan["max"]) == (2, 1)
    unechoed = post(asked)
    assert (unechoed.status_code, unechoed.json()["plan"]) == (409, plan)
    wrong = post({**asked, "expect": 3, "as_of": plan["as_of"]})
    assert wrong.status_code == 409 and wrong.json()["plan"]["emails"] == 2
    confirmed = {**asked, "expect": 2, "as_of": plan["as_of"]}
    over = post(confirmed)
    assert over.status_code == 400 and over.json()["error"].endswith("over_max takes them")
    assert {run_status(res, i) for i in [*ids, other]} == {"succeeded"}
    done = post({**confirmed, "over_max": True})
    assert done.status_code == 200, done.text
    assert (done.json()["taken"], done.json()["enqueued"]) == (2, 2)
    again = post({**confirmed, "over_max": True})
    assert again.status_code == 409 and again.json()["plan"]["emails"] == 0
    assert [run_status(res, i) for i in ids] == ["open"] * 2
    assert post({**asked, "expect": "2"}).status_code == 400


def test_the_api_serves_its_description(console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    web = console()
    answer = requests.get(f"{web.url}/api/openapi.yaml", auth=VIEWER, timeout=10)
    assert answer.status_code == 200
    assert yaml.safe_load(answer.text)["openapi"] == "3.1.0"


def test_machines_sign_in_with_a_bearer_token_of_their_role(res, console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    made = {}
    for name, role in (("ci-bot", "operator"), ("dashboard", "viewer")):
        run = subprocess.run(
            [sys.executable, "-m", "mailpipe.cli.main", "web-token", name, "--role", role],
            capture_output=True,
            text=True,
            check=True,
        )
        token = run.stdout.split("it is not kept): ")[1].split()[0]
        entry = run.stdout.split("MAILPIPE_WEB_TOKENS entry: ")[1].strip()
        made[role] = (token, entry)
    failed = failed_run(res)
    web = console({**os.environ, "MAILPIPE_WEB_TOKENS": ",".join(e for _, e in made.values())})
    api = f"{web.url}/api"

    def call(method: str, path: str, token: str, **kwargs: object) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return requests.request(method, f"{api}{path}", headers=headers, timeout=10, **kwargs)  # type: ignore[arg-type]

    operator, viewer = made["operator"][0], made["viewer"][0]
    assert call("GET", f"/search?q={failed}", viewer).json()["rows"][0]["email_id"] == failed
    assert call("POST", f"/emails/{failed}/retry", viewer, json={}).status_code == 403
    assert call("POST", "/stages/cpu/pause", viewer, json={}).status_code == 403
    wrong = call("GET", "/queues", "not-a-token")
    assert wrong.status_code == 401 and "error" in wrong.json()
    retried = call("POST", f"/emails/{failed}/retry", operator, json={})
    assert retried.json() == {"done": [failed], "enqueued": 1, "refused": {}}
    assert call("POST", "/stages/cpu/pause", operator, json={}).json()["paused"] is True
    assert call("POST", "/stages/cpu/resume", operator, json={}).json()["was_paused"] is True
    # The token is the API's: the pages sign in with a password.
    assert (
        requests.get(
            f"{web.url}/failed", headers={"Authorization": f"Bearer {operator}"}, timeout=10
        ).status_code
        == 401
    )
    assert "retry by api:token:ci-bot" in web.output()


def operator_headers() -> dict[str, str]:
    return {"Authorization": "Basic " + b64encode(":".join(OPERATOR).encode()).decode()}


def open_request(web: ConsoleProcess, head: dict[str, str]) -> socket.socket:
    """An operator's POST to /api/reprocess whose headers are sent, its body not yet."""
    conn = socket.create_connection(("127.0.0.1", web.port), timeout=10)
    lines = [
        "POST /api/reprocess HTTP/1.1",
        f"Host: 127.0.0.1:{web.port}",
        "Content-Type: application/json",
        "Connection: close",
        *(f"{name}: {value}" for name, value in {**operator_headers(), **head}.items()),
    ]
    conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return conn


def answer_of(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the answer on `conn`, read until the server closes."""
    received = b""
    while chunk := conn.recv(65536):
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


def test_an_action_s_body_is_refused_past_its_limit_before_it_is_read_whole(console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    web = console({**os.environ, "MAILPIPE_API_BODY_MAX_BYTES": "4096"})
    api = f"{web.url}/api"
    too_long = {"error": "the body is at most 4096 bytes"}

    # The limit is the body's length, to the byte (a resume reads no field of it).
    filler = {"pad": ""}
    filler["pad"] = "x" * (4096 - len(json.dumps(filler)))
    fits = requests.post(f"{api}/stages/cpu/resume", json=filler, auth=OPERATOR, timeout=10)
    assert fits.status_code == 200, fits.text
    filler["pad"] += "x"
    over = requests.post(f"{api}/stages/cpu/resume", json=filler, auth=OPERATOR, timeout=10)
    assert (over.status_code, over.json()) == (413, too_long)
    assert over.headers["x-content-type-options"] == "nosniff"

    # 200 MB declared: refused before a byte of it is sent.
    with open_request(web, {"Content-Length": str(200 * 1024 * 1024)}) as conn:
        status, headers, body = answer_of(conn)
    assert (status, json.loads(body)) == (413, too_long)
    assert headers["content-type"] == "application/json"

    # Chunked, with no length and no end: refused as it arrives, once past the limit. Each
    # chunk is given time to be read, so that the answer is the console's, not a reset.
    with open_request(web, {"Transfer-Encoding": "chunked"}) as conn:
        chunk = b"[" * 1024
        sent = 0
        while not select.select([conn], [], [], 0.2)[0]:
            assert sent <= 64 * 1024, "the console read 64 KiB of a 4 KiB limit"
            conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, headers, body = answer_of(conn)
    assert (status, json.loads(body)) == (413, too_long)
    assert 4096 < sent <= 8192


def test_a_body_nested_deeper_than_an_action_s_is_a_400(console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    web = console()
    too_deep = {"error": "the body is nested at most 4 levels deep"}
    deep_objects = b'{"on": ' * 5000 + b"true" + b"}" * 5000
    for body in (b"[" * 100_000, deep_objects, b'{"reason": [[[["deep"]]]]}'):
        answer = requests.put(
            f"{web.url}/api/model-calls",
            data=body,
            headers={"Content-Type": "application/json"},
            auth=OPERATOR,
            timeout=10,
        )
        assert (answer.status_code, answer.json()) == (400, too_deep), body[:20]
        assert answer.headers["x-content-type-options"] == "nosniff"
    four = requests.post(
        f"{web.url}/api/stages/cpu/resume", json={"a": [[["deep"]]]}, auth=OPERATOR, timeout=10
    )
    assert four.status_code == 200, four.text


def test_every_api_error_is_json_with_the_security_headers(console) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/mailpipe"
    web = console({**os.environ, "MAILPIPE_DATABASE_URL": unreachable})
    for method, path, status in (
        ("GET", "/api/no-such-thing", 404),
        ("PUT", "/api/queues", 405),
        ("POST", "/api/jobs/1", 405),
        ("GET", "/api/review", 500),  # its database is gone
    ):
        answer = requests.request(method, f"{web.url}{path}", auth=VIEWER, timeout=30)
        assert answer.status_code == status, (path, answer.text)
        assert answer.headers["content-type"] == "application/json", path
        assert set(answer.json()) == {"error"}, path
        assert answer.headers["content-security-policy"].startswith("default-src 'none'"), path
    assert "internal error" in answer.json()["error"]
    # The pages answer the same failure in text, inside the same headers.
    page = requests.get(f"{web.url}/review", auth=VIEWER, timeout=30)
    assert (page.status_code, page.headers["x-content-type-options"]) == (500, "nosniff")
    assert page.text.startswith("500: internal error")
    assert "GET /api/review failed" in web.output()
