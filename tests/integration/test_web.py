"""The console and the job status API (`mailpipe web`, mailpipe/web/), as a real server process
over the test's database and Redis.

- Who may do what: no credentials or a wrong password is 401 with a basic-auth challenge; a
  viewer reads and is refused every action (403); an operator's action needs the form's CSRF
  token (403 without it, with another user's or with an expired one); a right one acts, through
  the same code as the CLI, and is logged with its user and emails. How sign-in is bounded:
  tests/integration/test_web_signin.py.
- /healthz answers while every thread of the pool waits on the database.
- A number or a byte a page or the API cannot read is a 400 that says so, never a 500.
- Pages escape what the emails hold, and no email content reaches the console's log.
- The API answers each state of a job as the database and the broker hold it: `queued` and
  `running` seen on a real worker whose job is held in its steps (tests/support/faults.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import requests
from sqlalchemy import insert, select, text, update

from mailpipe.broker.queues import Stage
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses
from mailpipe.operations.status import reprocesses
from mailpipe.pipeline import emails, job, runs
from mailpipe.storage import flags
from mailpipe.storage.keys import raw_email_key
from mailpipe.storage.models import EmailMessage, PipelineRun, RunAttempt, RunStatus, utcnow
from mailpipe.web.auth import CSRF_MAX_AGE, csrf_token
from tests.support.console import OPERATOR, OPERATOR_ARGON2, VIEWER, ConsoleProcess, users_env
from tests.support.emails import raw_email
from tests.support.fleet import Fleet
from tests.support.searched import store_searched
from tests.support.switches import set_model_calls
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

HOSTILE = "<script>alert('subject')</script>"
SECRET = "the console's CSRF key in these tests, 32 bytes or more"


def email(tag: str) -> bytes:
    return raw_email(
        f"about {tag}",
        to="b@example.org",
        body=f"Hello {tag}",
        message_id=f"{tag}.{os.urandom(6).hex()}@example.org",
    )


def store_without_blob(res, raw: bytes) -> int:  # type: ignore[no-untyped-def]
    """An email row whose raw bytes were never written: its job fails with BlobMissing."""
    digest = hashlib.sha256(raw).hexdigest()
    with res.db.transaction() as session:
        return int(
            session.scalar(
                insert(EmailMessage)
                .values(
                    blob_key=raw_email_key(digest),
                    size=len(raw),
                    sha256=digest,
                    received_at=utcnow(),
                )
                .returning(EmailMessage.id)
            )
        )


def failed_run(res, error: str = "the test failed it") -> int:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [email("failed")])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
        assert runs.fail(session, email_id, error, error_class="DeferredTooLong")
    return email_id


def run_status(res, email_id: int) -> str | None:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        status = session.scalar(select(PipelineRun.status).where(PipelineRun.email_id == email_id))
    return None if status is None else status.value


def redirected(web: ConsoleProcess, path: str, token: str, form: dict[str, str]) -> str:
    """Where an operator's form posted to `path` sends the browser (a 303 asserted)."""
    answer = requests.post(
        f"{web.url}{path}",
        data={**form, "csrf_token": token},
        auth=OPERATOR,
        allow_redirects=False,
        timeout=10,
    )
    assert answer.status_code == 303, answer.text
    return str(answer.headers["location"])


@pytest.fixture
def console(res, tmp_path: Path) -> Iterator[Callable[..., ConsoleProcess]]:  # type: ignore[no-untyped-def]
    """Starts `mailpipe web` with the test's users, on the test's services unless told others."""
    started: list[ConsoleProcess] = []

    def start(env: dict[str, str] | None = None) -> ConsoleProcess:
        process = ConsoleProcess(
            {**(env or os.environ), **users_env()}, tmp_path / f"web{len(started)}.log"
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


# --- who may do what ---------------------------------------------------------------------------


def test_signing_in(console) -> None:  # type: ignore[no-untyped-def]
    web = console()
    assert requests.get(f"{web.url}/healthz", timeout=5).status_code == 200
    for path in (
        "/",
        "/failed",
        "/review",
        "/search",
        "/emails/1",
        "/api/queues",
        "/api/jobs/1",
        "/api/search",
    ):
        refused = requests.get(f"{web.url}{path}", timeout=5)
        assert refused.status_code == 401, path
        assert refused.headers["WWW-Authenticate"].startswith('Basic realm="mailpipe"')
    assert requests.get(f"{web.url}/api/queues", timeout=5).json() == {
        "error": "sign in as a viewer or an operator"
    }
    for wrong in ((OPERATOR[0], "wrong"), (VIEWER[0], OPERATOR[1]), ("nobody", OPERATOR[1])):
        assert requests.get(f"{web.url}/", auth=wrong, timeout=5).status_code == 401, wrong
    # Each way a password is held: plain, argon2, bcrypt; twice each (the second from the cache).
    for user in (OPERATOR, OPERATOR_ARGON2, VIEWER, OPERATOR, OPERATOR_ARGON2, VIEWER):
        page = requests.get(f"{web.url}/failed", auth=user, timeout=10)
        assert page.status_code == 200, user
        assert (">Retry selected<" in page.text) == (user != VIEWER)
    for secret in (OPERATOR[1], OPERATOR_ARGON2[1], VIEWER[1]):
        assert secret not in web.output()


def test_actions_need_an_operator_and_the_form_s_token(res, console) -> None:  # type: ignore[no-untyped-def]
    email_id = failed_run(res)
    web = console({**os.environ, "MAILPIPE_WEB_SECRET": SECRET})
    viewer_token = web.csrf(VIEWER)
    assert viewer_token != web.csrf(OPERATOR)
    retry = {"do": "retry-selected", "email_id": str(email_id)}

    def post(auth: tuple[str, str], form: dict[str, str]) -> requests.Response:
        return requests.post(
            f"{web.url}/failed", data=form, auth=auth, allow_redirects=False, timeout=10
        )

    assert post(VIEWER, {**retry, "csrf_token": viewer_token}).status_code == 403
    for token, refused in (
        (None, "the form has no token"),
        (viewer_token, "the form's token is another user's"),
        ("0" * 64, "the form's token is wrong"),
        (expired_token(web.env, OPERATOR[0]), "the form's token has expired"),
    ):
        answer = post(OPERATOR, {**retry, "csrf_token": token} if token else retry)
        assert answer.status_code == 403, token
        assert answer.text.startswith(f"403: {refused}"), answer.text
    assert run_status(res, email_id) == "failed"

    operator_token = web.csrf(OPERATOR)  # a fresh one, from the page reloaded
    done = post(OPERATOR, {**retry, "csrf_token": operator_token})
    assert done.status_code == 303
    assert done.headers["location"] == "/failed?action=retry&done=1&enqueued=1&refused=0"
    assert run_status(res, email_id) == "open"
    page = requests.get(f"{web.url}{done.headers['location']}", auth=OPERATOR, timeout=10)
    assert "1 retried, 1 jobs sent" in page.text
    # Pausing a stage and switching model calls, as the overview's buttons do.
    overview = {"csrf_token": operator_token}
    stages = f"{web.url}/stages"
    paused = requests.post(
        stages, data={**overview, "stage": "model", "do": "pause"}, auth=OPERATOR
    )
    assert paused.status_code == 200 and paused.url == f"{web.url}/"  # after the 303
    assert pauses.paused(res.redis)[Stage.MODEL].by == pauses.OPERATOR
    assert "Resume" in paused.text
    requests.post(stages, data={**overview, "stage": "model", "do": "resume"}, auth=OPERATOR)
    assert pauses.paused(res.redis) == {}
    with res.db.session() as session:
        before = flags.model_calls_enabled(session)
    state = "off" if before else "on"
    switched = requests.post(
        f"{web.url}/model-calls", data={**overview, "state": state}, auth=OPERATOR
    )
    assert switched.status_code == 200
    with res.db.session() as session:
        assert flags.model_calls_enabled(session) is not before
    # One audit line per act, the operation's, with its user; refused ones did nothing.
    assert audit_lines(web.output()) == [
        f"retry by web:ops: 1 email(s): {email_id}",
        "pause_model by web:ops",
        "resume_model by web:ops",
        f"model_calls_{state} by web:ops",
    ]


def audit_lines(log: str) -> list[str]:
    """The console's audit lines, written by the operations it calls (`actions`), as read."""
    return re.findall(r"/mailpipe\.operations\.actions\] (.*)", log)


def expired_token(env: dict[str, str], user: str) -> str:
    """`user`'s CSRF token under the console's secret, made a little longer ago than a token
    lasts."""
    made = time.time() - CSRF_MAX_AGE - 60
    with mock.patch("time.time", return_value=made):
        return csrf_token(env["MAILPIPE_WEB_SECRET"].encode(), user)


def test_a_console_without_users_serves_loopback_names_only(res, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Open on loopback, as Flower is; a page whose name points at 127.0.0.1 (DNS rebinding)
    gets nothing."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MAILPIPE_WEB_OPERATORS", "MAILPIPE_WEB_VIEWERS")
    }
    web = ConsoleProcess(env, tmp_path / "web.log")
    try:
        assert requests.get(f"{web.url}/api/queues", timeout=10).status_code == 200
        rebound = requests.get(
            f"{web.url}/api/queues", headers={"Host": "attacker.example"}, timeout=10
        )
        assert rebound.status_code == 400
        # Its actions still need the token: another site's form cannot send it.
        refused = requests.post(f"{web.url}/stages", data={"stage": "cpu", "do": "pause"})
        assert refused.status_code == 403
        assert pauses.paused(res.redis) == {}
    finally:
        web.stop()


def test_web_refuses_every_interface_without_users(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in ("MAILPIPE_WEB_OPERATORS", "MAILPIPE_WEB_VIEWERS")
        },
        "MAILPIPE_WEB_HOST": "0.0.0.0",
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mailpipe"), "web"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: mailpipe web refuses to serve 0.0.0.0 without users")
    assert "MAILPIPE_WEB_OPERATORS" in lines[0]


def test_healthz_answers_while_every_thread_waits_on_the_database(res, console) -> None:  # type: ignore[no-untyped-def]
    """/healthz runs on the event loop: pages that hold every thread of the pool, waiting on a
    locked table, do not hold it up (a health check that fails so has the task replaced)."""
    web = console()
    threads = ThreadPoolExecutor(50)
    try:
        with res.db.transaction() as session:
            session.execute(text("LOCK TABLE pipeline_run IN ACCESS EXCLUSIVE MODE"))
            pages = [
                threads.submit(requests.get, f"{web.url}/failed", auth=VIEWER, timeout=60)
                for _ in range(50)  # more than the pool's 40 threads
            ]
            wait_for(lambda: waiting_on_a_lock(res) >= 4, 30, "the pages' connections to wait")
            try:
                healthz = requests.get(f"{web.url}/healthz", timeout=5)
            except requests.Timeout:
                pytest.fail("/healthz waited for a thread")
            assert healthz.status_code == 200
            assert not any(page.done() for page in pages)
        assert [page.result().status_code for page in pages] == [200] * 50
    finally:
        threads.shutdown()


def waiting_on_a_lock(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return int(
            session.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            )
        )


# --- what the pages show -----------------------------------------------------------------------


def test_pages_escape_what_emails_hold(res, console) -> None:  # type: ignore[no-untyped-def]
    email_id = failed_run(res, error=f"failed on {HOSTILE}")
    with res.db.transaction() as session:
        session.execute(
            update(EmailMessage).where(EmailMessage.id == email_id).values(subject=HOSTILE)
        )
        emails.mark_for_review(session, [email_id], f"reason {HOSTILE}")
    web = console()
    for path in ("/review", "/failed", f"/emails/{email_id}"):
        page = requests.get(f"{web.url}{path}", auth=VIEWER, timeout=10)
        assert page.status_code == 200, path
        assert "<script>alert" not in page.text, path
        assert "&lt;script&gt;alert(" in page.text, path
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert "alert" not in web.output()


def test_the_overview_names_the_paused_mailboxes_with_their_waiting_counts(res, console) -> None:  # type: ignore[no-untyped-def]
    from mailpipe.enqueue import sender
    from mailpipe.operations import actions

    web = console()
    page = requests.get(f"{web.url}/", auth=VIEWER, timeout=10)
    assert 'id="paused-mailboxes"' not in page.text
    store_emails(res, [email(f"held {i}") for i in range(3)], mailbox=HOSTILE)
    actions.pause_mailbox(res, HOSTILE, "under investigation", user="ops")
    actions.pause_mailbox(res, "default", "runaway import", user="ops")

    page = requests.get(f"{web.url}/", auth=VIEWER, timeout=10)
    [banner] = re.findall(r'<p class="problem" id="paused-mailboxes">.*?</p>', page.text, re.S)
    assert banner.startswith('<p class="problem" id="paused-mailboxes">2 mailboxes are paused')
    assert "&lt;script&gt;alert(" in banner and "<script>alert" not in banner
    assert re.search(r"&lt;/script&gt;</span> \(3 waiting, since ", banner), banner
    assert re.search(r">default</span> \(0 waiting, since ", banner), banner
    actions.resume_mailbox(res, "default", enqueue=sender(res), user="ops")
    page = requests.get(f"{web.url}/", auth=VIEWER, timeout=10)
    assert "1 mailbox is paused" in page.text


def test_pages_take_their_style_and_script_from_the_console_alone(console) -> None:  # type: ignore[no-untyped-def]
    """No inline style or script, which the Content-Security-Policy would block: the console's
    own files, served as what they are."""
    web = console()
    for path in ("/", "/failed", "/review", "/search?state=failed"):
        page = requests.get(f"{web.url}{path}", auth=OPERATOR, timeout=10)
        assert page.status_code == 200, path
        policy = page.headers["content-security-policy"]
        assert "'unsafe-inline'" not in policy
        assert "style-src 'self'" in policy and "script-src 'self'" in policy
        assert not re.search(r"<style|<script(?![^>]*\ssrc=)|\s(style|on[a-z]+)=", page.text), path
        assert '<link rel="stylesheet" href="/static/console.css">' in page.text, path
        assert '<script src="/static/console.js" defer></script>' in page.text, path
    for name, kind in (("console.css", "text/css"), ("console.js", "text/javascript")):
        served = requests.get(f"{web.url}/static/{name}", auth=VIEWER, timeout=10)
        assert served.status_code == 200, name
        assert served.headers["content-type"] == f"{kind}; charset=utf-8"
        assert served.headers["x-content-type-options"] == "nosniff"
        assert served.text.strip()
    assert requests.get(f"{web.url}/static/console.css", timeout=10).status_code == 401


def test_the_api_answers_in_json_and_the_pages_in_text(res, console) -> None:  # type: ignore[no-untyped-def]
    """Each Mount answers its own refusals: JSON under /api/, a line of text on the pages."""
    web = console()
    not_an_id = "an email id is a whole number from 1 to 9223372036854775807"
    for path, status, error in (
        ("/api/jobs/987654321", 404, "no email with id 987654321"),
        ("/api/jobs/abc", 400, not_an_id),
        ("/api/jobs/99999999999999999999", 400, not_an_id),
        ("/api/jobs/9223372036854775808", 400, not_an_id),
        ("/api/jobs/-1", 400, not_an_id),
        ("/api/jobs/%00", 400, not_an_id),
        ("/api/jobs/%D9%A1", 400, not_an_id),  # an Arabic-Indic 1, which int() would take
        ("/api/no-such-thing", 404, "Not Found"),
    ):
        answer = requests.get(f"{web.url}{path}", auth=VIEWER, timeout=10)
        assert answer.status_code == status, path
        assert answer.headers["content-type"] == "application/json", path
        assert answer.json() == {"error": error}
    not_a_page = "page is a whole number from 1 to 1000000000"
    for path, status, error, auth in (
        ("/emails/987654321", 404, "no email with id 987654321", VIEWER),
        ("/emails/abc", 400, not_an_id, VIEWER),
        ("/emails/99999999999999999999", 400, not_an_id, VIEWER),
        ("/emails/1%00", 400, not_an_id, VIEWER),
        ("/failed?page=99999999999999999999", 400, not_a_page, VIEWER),
        ("/failed?page=0", 400, not_a_page, VIEWER),
        ("/failed?page=1e3", 400, not_a_page, VIEWER),
        ("/review?page=99999999999999999999", 400, not_a_page, VIEWER),
        ("/review?page=%00", 400, not_a_page, VIEWER),
        ("/no-such-page", 404, "Not Found", VIEWER),
        ("/failed", 401, "sign in as a viewer or an operator", None),
    ):
        answer = requests.get(f"{web.url}{path}", auth=auth, timeout=10)
        assert answer.status_code == status, path
        assert answer.headers["content-type"] == "text/plain; charset=utf-8", path
        assert answer.text == f"{status}: {error}\n"
    # A filter the failed list cannot read: the page, with the problem named, and 400.
    for value in ("%00", "Blob%00Missing", "%FF", "%1B[31m"):
        answer = requests.get(f"{web.url}/failed?error_class={value}", auth=VIEWER, timeout=10)
        assert answer.status_code == 400, value
        assert "error_class is text without control characters, in UTF-8" in answer.text
    # And the same in an operator's form.
    token = web.csrf(OPERATOR)
    for form in (
        {"do": "retry-selected", "email_id": "99999999999999999999"},
        {"do": "dismiss-matching", "error_class": "\x00"},
    ):
        answer = requests.post(
            f"{web.url}/failed", data={**form, "csrf_token": token}, auth=OPERATOR, timeout=10
        )
        assert answer.status_code == 400, form


# --- the job status API on a real worker -------------------------------------------------------


def test_the_api_answers_each_state_as_the_fleet_holds_it(res, fleet, console) -> None:  # type: ignore[no-untyped-def]
    # A retry of the transient fault waits up to a minute: long enough to be seen waiting.
    f: Fleet = fleet(MAILPIPE_RETRY_BACKOFF_MAX="60", MAILPIPE_VISIBILITY_TIMEOUT="120")
    worker = f.worker("web-api", "--concurrency", "1", "--prefetch-multiplier", "1")
    web = console(f.env)

    def job(email_id: int) -> dict[str, Any]:
        answer = requests.get(f"{web.url}/api/jobs/{email_id}", auth=VIEWER, timeout=10)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def state_is(email_id: int, state: str) -> Callable[[], bool]:
        return lambda: job(email_id)["state"] == state

    held, waiting, never, retried, paused, lost = store_emails(res, [email(t) for t in "hwnrpl"])
    missing = store_without_blob(res, email("missing"))
    copied = email("copied")
    first, second = store_emails(res, [copied, copied])

    assert job(never)["state"] == "not_enqueued"
    # One child: the held job runs, the next waits in the queue behind it.
    f.set_fault(held, "held", times=1)
    f.enqueue([held])
    wait_for(state_is(held, "running"), 60, "the held job to be running")
    f.enqueue([waiting])
    wait_for(lambda: f.queue_depth() == 1, 30, "the second job to wait in the queue")
    assert job(waiting)["state"] == "queued"
    assert job(held)["state"] == "running"
    f.release(held)
    assert wait_until_closed(res, [held, waiting]) == {held: "succeeded", waiting: "succeeded"}

    f.set_fault(retried, "transient:50", times=1)
    f.enqueue([missing, first, retried])
    assert wait_until_closed(res, [missing, first]) == {missing: "failed", first: "succeeded"}
    f.enqueue([second])
    assert wait_until_closed(res, [second]) == {second: "duplicate"}
    wait_for(state_is(retried, "retrying"), 60, "the transient fault's retry to be waiting")

    # A job behind an operator's pause waits, and says so; a job whose run is open but whose
    # message is gone (no marker, no lease) is lost until a sweep re-adds it.
    f.cli("pause", "cpu")
    queue = res.settings.queue
    wait_for(lambda: queue not in f.consumed_queues(worker.nodename), 30, "the pause applied")
    f.enqueue([paused])
    assert job(paused)["state"] == "waiting" and job(paused)["waiting_for"] == "paused_stage"
    f.cli("resume", "cpu")
    assert wait_until_closed(res, [paused]) == {paused: "succeeded"}
    with res.db.transaction() as session:
        runs.ensure_runs(session, [lost])
    assert job(lost)["state"] == "lost"

    with res.db.session() as session:
        runs_by_email = {
            run.email_id: run
            for run in session.scalars(
                select(PipelineRun).where(
                    PipelineRun.email_id.in_([held, waiting, missing, first, second, retried])
                )
            )
        }
    expected = {
        held: "succeeded",
        waiting: "succeeded",
        missing: "failed",
        first: "succeeded",
        second: "duplicate",
        retried: "retrying",
        never: "not_enqueued",
    }
    for email_id, state in expected.items():
        answer = job(email_id)
        assert answer["email_id"] == email_id and answer["state"] == state, answer
        run = runs_by_email.get(email_id)
        if run is None:
            assert answer["attempts"] == 0 and answer["history"] == []
            continue
        assert answer["attempts"] == run.attempts
        assert answer["error"] == run.error
        if run.status is not RunStatus.OPEN:
            assert answer["history"], answer  # every attempt is recorded
    assert job(missing)["history"][-1]["error_class"] == "BlobMissing"
    queues = requests.get(f"{web.url}/api/queues", auth=VIEWER, timeout=10).json()
    assert set(queues["queues"]) == {"email", "email.bulk", "model", "model.bulk", "control"}
    assert queues["runs"]["failed"] == 1 and queues["runs"]["duplicate"] == 1
    assert queues["estimated"] == []
    assert [w["hostname"] for w in queues["workers"]] == ["web-api@localhost"]


# --- the search ---------------------------------------------------------------------------------


def test_every_page_has_the_search_box_and_an_id_in_it_opens_the_email(res, console) -> None:  # type: ignore[no-untyped-def]
    ids = store_searched(res)
    web = console()
    box = '<form class="search" method="get" action="/search" role="search">'
    for path in ("/", "/failed", "/review", "/search", f"/emails/{ids['alert']}"):
        page = requests.get(f"{web.url}{path}", auth=VIEWER, timeout=10)
        assert page.status_code == 200, path
        assert box in page.text and '<input type="search" name="q"' in page.text, path
    typed = requests.get(
        f"{web.url}/search",
        params={"q": f" {ids['alert']} "},
        auth=VIEWER,
        timeout=10,
        allow_redirects=False,
    )
    assert typed.status_code == 303
    assert typed.headers["location"] == f"/emails/{ids['alert']}"


def test_the_search_page_and_the_api_find_the_same_emails(res, console) -> None:  # type: ignore[no-untyped-def]
    ids = store_searched(res)
    web = console()
    for query, names in (
        ({"sender": "billing@", "state": "dismissed"}, ["overdue"]),
        ({"q": "<INV-0142@acme.example>"}, ["copy", "invoice"]),
        ({"label": "invoice"}, ["overdue", "invoice"]),
    ):
        expected = [ids[name] for name in names]
        answer = requests.get(f"{web.url}/api/search", params=query, auth=VIEWER, timeout=10)
        assert answer.status_code == 200, answer.text
        assert [row["email_id"] for row in answer.json()["rows"]] == expected
        assert answer.json()["next_before"] is None
        page = requests.get(f"{web.url}/search", params=query, auth=VIEWER, timeout=10)
        assert page.status_code == 200, page.text
        linked = re.findall(r'<td><a href="/emails/(\d+)">', page.text)
        assert [int(email_id) for email_id in linked] == expected, query
    page = requests.get(
        f"{web.url}/search", params={"q": "nothing-like-it"}, auth=VIEWER, timeout=10
    )
    assert "No email found." in page.text
    # What the box read is shown in the form's field it stands for.
    assert 'name="subject" value="nothing-like-it"' in page.text


def test_the_console_and_the_api_filter_by_mailbox_and_show_it(res, console) -> None:  # type: ignore[no-untyped-def]
    ids = store_searched(res)
    web = console()

    def get(path: str, **query: str) -> requests.Response:
        answer = requests.get(f"{web.url}{path}", params=query, auth=VIEWER, timeout=10)
        assert answer.status_code == 200, (path, answer.text)
        return answer

    def listed(page: requests.Response) -> list[tuple[int, str]]:
        row = r'<a href="/emails/(\d+)">.*?<td class="mailbox">([^<]*)</td>'
        rows = re.findall(row, page.text, re.S)
        return [(int(email_id), mailbox) for email_id, mailbox in rows]

    found = get("/search", q="mailbox:acme")
    assert listed(found) == [(ids["alert"], "acme"), (ids["invoice"], "acme")]
    assert 'name="mailbox" value="acme"' in found.text  # what the box read, in its field
    rows = get("/api/search", mailbox="globex").json()["rows"]
    assert [(row["email_id"], row["mailbox"]) for row in rows] == [(ids["copy"], "globex")]
    rows = get("/api/search", q="mailbox:default", label="invoice").json()["rows"]
    assert [(row["email_id"], row["mailbox"]) for row in rows] == [(ids["overdue"], "default")]

    assert listed(get("/failed", mailbox="acme")) == [(ids["alert"], "acme")]
    assert listed(get("/failed", mailbox="globex")) == []
    rows = get("/api/failed", mailbox="acme").json()["rows"]
    assert [(row["email_id"], row["mailbox"]) for row in rows] == [(ids["alert"], "acme")]
    assert sorted(listed(get("/review"))) == [(ids["alert"], "acme"), (ids["overdue"], "default")]
    assert '<dd id="mailbox">globex</dd>' in get(f"/emails/{ids['copy']}").text
    assert get(f"/api/jobs/{ids['copy']}").json()["mailbox"] == "globex"
    assert get(f"/api/jobs/{ids['overdue']}").json()["mailbox"] == "default"

    refused = requests.get(f"{web.url}/api/search", params={"q": "mailbox:"}, auth=VIEWER)
    assert refused.json() == {"error": "mailbox: a mailbox's name is empty"}
    assert "acme" not in web.output() and "globex" not in web.output()


def test_a_bad_search_is_a_400_with_the_reason_in_one_line(console) -> None:  # type: ignore[no-untyped-def]
    web = console()
    for query, reason in (
        ({"since": "last tuesday"}, "since is a date or a date and time"),
        (
            {"state": "lost"},
            "state is one of no_run, open, succeeded, duplicate, failed, dismissed",
        ),
        ({"sender": "a\x00b@x"}, "sender is text without control characters"),
        ({"before": "9" * 30}, "before is a whole number from 1 to 9223372036854775807"),
        ({"q": "99999999999999999999"}, "an email id is a whole number"),
        ({"colour": "red"}, "unknown filter colour"),
        ({"since": "0001-01-01T00:00+01:00"}, "since is out of range: from 0001-01-01"),
    ):
        answer = requests.get(f"{web.url}/api/search", params=query, auth=VIEWER, timeout=10)
        assert answer.status_code == 400, query
        assert answer.headers["content-type"] == "application/json"
        assert answer.headers["x-content-type-options"] == "nosniff"
        error = answer.json()["error"]
        assert reason in error and "\n" not in error, error
        page = requests.get(f"{web.url}/search", params=query, auth=VIEWER, timeout=10)
        assert page.status_code == 400, query
        [problem] = re.findall(r'<p class="problem">([^<]*)</p>', page.text)
        assert reason in problem, problem


def test_the_results_escape_what_emails_hold(res, console) -> None:  # type: ignore[no-untyped-def]
    ids = store_searched(res)
    with res.db.transaction() as session:
        session.execute(
            update(EmailMessage)
            .where(EmailMessage.id == ids["lunch"])
            .values(subject=f"Lunch {HOSTILE}", sender=f"{HOSTILE} <x@corp.example>")
        )
    web = console()
    page = requests.get(f"{web.url}/search", params={"subject": "lunch"}, auth=VIEWER, timeout=10)
    assert page.status_code == 200
    assert f'<a href="/emails/{ids["lunch"]}">' in page.text
    assert "<script>alert" not in page.text
    assert page.text.count("&lt;script&gt;alert(") == 2
    assert "alert('subject')" not in web.output()


# --- acting where the operator stands ---------------------------------------------------------


def test_an_email_s_page_offers_what_applies_to_it_and_acts_there(res, console) -> None:  # type: ignore[no-untyped-def]
    failed = failed_run(res)
    with res.db.transaction() as session:
        emails.mark_for_review(session, [failed], "looked odd")
    [succeeded] = store_emails(res, [email("succeeded")])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [succeeded])
        run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == succeeded)).one()
        run.status, run.closed_at = RunStatus.SUCCEEDED, utcnow()
    web = console()
    token = web.csrf(OPERATOR)

    def offered(email_id: int) -> set[str]:
        page = requests.get(f"{web.url}/emails/{email_id}", auth=OPERATOR, timeout=10).text
        return set(re.findall(r'<button name="do" value="([a-z-]+)"', page))

    def act(email_id: int, **form: str) -> str:
        return redirected(web, f"/emails/{email_id}/act", token, form)

    assert offered(failed) == {"retry", "dismiss", "clear-review", "forget"}
    assert offered(succeeded) == {"reprocess", "forget"}
    viewer_page = requests.get(f"{web.url}/emails/{failed}", auth=VIEWER, timeout=10).text
    assert 'name="do"' not in viewer_page  # a viewer reads

    assert (
        act(failed, do="dismiss") == f"/emails/{failed}?action=dismiss&done=1&enqueued=0&refused=0"
    )
    assert offered(failed) == {"retry", "undo-dismiss", "forget"}  # the review mark went too
    dismissed_view = requests.get(f"{web.url}/failed?view=dismissed", auth=VIEWER, timeout=10)
    assert f'href="/emails/{failed}"' in dismissed_view.text
    assert (
        f'href="/emails/{failed}"'
        not in requests.get(f"{web.url}/failed", auth=VIEWER, timeout=10).text
    )
    act(failed, do="undo-dismiss")
    assert offered(failed) == {"retry", "dismiss", "forget"}
    assert (
        f'href="/emails/{failed}"'
        in requests.get(f"{web.url}/failed", auth=VIEWER, timeout=10).text
    )

    done = act(succeeded, do="reprocess", **{"from": "parse", "lane": "bulk"})
    assert done == f"/emails/{succeeded}?action=reprocess&done=1&enqueued=1&refused=0"
    assert run_status(res, succeeded) == "open"
    page = requests.get(f"{web.url}{done}", auth=OPERATOR, timeout=10).text
    assert "1 reprocessed, 1 jobs sent" in page
    # Its run is open now: reprocessing it again takes nothing.
    again = act(succeeded, do="reprocess", **{"from": "parse", "lane": "bulk"})
    assert again.endswith("done=0&enqueued=0&refused=1")
    # The lane's button posts the same act, as the API's `lane` does.
    page = requests.get(f"{web.url}/emails/{succeeded}", auth=OPERATOR, timeout=10).text
    assert '<input type="hidden" name="do" value="lane">' in page
    [other] = re.findall(r'<button name="lane" value="(live|bulk)">', page)
    moved = act(succeeded, do="lane", lane=other)
    assert moved == f"/emails/{succeeded}?action=lane&done=1&enqueued=0&refused=0"
    page = requests.get(f"{web.url}{moved}", auth=OPERATOR, timeout=10).text
    assert f'<dd id="lane">{other}' in page and "1 moved to the other lane" in page
    audit = audit_lines(web.output())
    assert audit[:2] == [
        f"dismiss by web:ops: 1 email(s): {failed}",
        f"undo_dismiss by web:ops: 1 email(s): {failed}",
    ]
    assert re.fullmatch(r"reprocess_\d+_from_parse by web:ops", audit[2])
    assert re.fullmatch(rf"reprocess_\d+ by web:ops: 1 email\(s\): {succeeded}", audit[3])
    assert audit[4:] == [
        f"move_to_{other} by web:ops: 1 email(s): {succeeded}"
    ]  # the second reprocess took none

    # Forgotten once its box is ticked: to the search, the email's page gone with it.
    unticked = requests.post(
        f"{web.url}/emails/{failed}/act",
        data={"do": "forget", "csrf_token": token},
        auth=OPERATOR,
        timeout=10,
    )
    assert unticked.status_code == 400 and run_status(res, failed) == "failed"
    assert act(failed, do="forget", confirm="yes") == "/search?action=forget&done=1"
    assert (
        "1 forgotten"
        in requests.get(f"{web.url}/search?action=forget&done=1", auth=OPERATOR, timeout=10).text
    )
    assert requests.get(f"{web.url}/emails/{failed}", auth=OPERATOR, timeout=10).status_code == 404
    assert f"forget by web:{OPERATOR[0]} email_id={failed} " in web.output()


def test_an_email_s_page_says_what_its_forget_makes_of_its_copy(res, console) -> None:  # type: ignore[no-untyped-def]
    raw = email("copied")
    first, copy = store_emails(res, [raw, raw])
    assert [job.process_email(res, i).kind.value for i in (first, copy)][1] == "duplicate"
    web = console()

    def note(email_id: int) -> str | None:
        page = requests.get(f"{web.url}/emails/{email_id}", auth=OPERATOR, timeout=10).text
        found = re.search(r'<p id="forget-copy">(.*?)</p>', page, re.S)
        return None if found is None else re.sub(r"<[^>]+>", "", found[1])

    assert note(first) == (
        f"Its copy email {copy} then becomes the first email of its origin: it keeps this "
        "email's labels and runs the steps a copy skips (documents, then classification), from "
        "its CPU stage."
    )
    assert note(copy) is None


# --- the overview's activity charts -------------------------------------------------------------


def test_the_overview_draws_what_the_activity_api_gives(res, console) -> None:  # type: ignore[no-untyped-def]
    """The overview's charts and `/api/activity` read one function: the attempts that just
    ended are in both, over the hour and the day; another window is a 400 in each one's format;
    the charts carry no inline style."""
    email_id = failed_run(res)
    with res.db.transaction() as session:
        run_id = session.scalar(select(PipelineRun.id).where(PipelineRun.email_id == email_id))
        ended = utcnow()
        session.execute(
            insert(RunAttempt),
            [
                {
                    "run_id": run_id,
                    "email_id": email_id,
                    "stage": stage,
                    "attempt": 1,
                    "started_at": ended - timedelta(seconds=2),
                    "ended_at": ended,
                    "outcome": outcome,
                }
                for stage, outcome in [("cpu", "succeeded")] * 3 + [("model", "failed")]
            ],
        )
    web = console()
    for window, buckets in (("hour", 60), ("day", 96)):
        given = requests.get(
            f"{web.url}/api/activity", params={"window": window}, auth=VIEWER, timeout=10
        ).json()
        assert (given["window"], len(given["times"])) == (window, buckets)
        cpu, model = given["stages"]["cpu"], given["stages"]["model"]
        assert sum(cpu["jobs"]["succeeded"]) == 3 and sum(model["jobs"]["failed"]) == 1
        assert [p for p in cpu["p50_s"] if p is not None] == [2.0]
        page = requests.get(f"{web.url}/", params={"window": window}, auth=VIEWER, timeout=10)
        assert page.status_code == 200
        assert "<span><b>3</b> succeeded</span>" in page.text
        assert re.search(rf'class="here" aria-current="page">Last {window}<', page.text)
        assert page.text.count("<svg ") == 6  # per stage its attempts and durations; the lanes'
        assert not re.search(r"\s(style|on[a-z]+)=", page.text)
    unnamed = requests.get(f"{web.url}/api/activity", auth=VIEWER, timeout=10).json()
    assert unnamed["window"] == "hour"  # unless told otherwise
    overview = requests.get(f"{web.url}/", auth=VIEWER, timeout=10).text
    assert 'class="here" aria-current="page">Last hour<' in overview
    refused = requests.get(f"{web.url}/api/activity?window=week", auth=VIEWER, timeout=10)
    assert (refused.status_code, refused.json()) == (400, {"error": "window is hour or day"})
    refused = requests.get(f"{web.url}/?window=week", auth=VIEWER, timeout=10)
    assert (refused.status_code, refused.text) == (400, "400: window is hour or day\n")


def test_a_search_s_emails_are_reprocessed_once_its_plan_is_confirmed(res, console) -> None:  # type: ignore[no-untyped-def]
    """The search's "Reprocess" shows the plan (its count, its model calls) and the form that
    takes it; a post without the plan's count, or with another, takes nothing and shows the
    plan as it is now; the plan confirmed twice takes each email once."""
    from tests.unit.operations.test_reprocess import OTHER
    from tests.unit.pipeline.test_job import INVOICE, PLAIN

    set_model_calls(res, True)
    ids = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    assert [job.process_email(res, i).kind.value for i in [*ids, other]] == ["succeeded"] * 3
    web = console()
    token = web.csrf(OPERATOR)
    page = requests.get(f"{web.url}/search?label=invoice", auth=OPERATOR, timeout=10).text
    assert re.search(
        r'<form class="actions" id="reprocess" method="get" action="/reprocess">', page
    )
    viewer = requests.get(f"{web.url}/search?label=invoice", auth=VIEWER, timeout=10).text
    assert 'id="reprocess"' not in viewer
    plan_query = {"label": "invoice", "from": "classify", "in_lane": "bulk"}

    def plan(**query: str) -> str:
        shown = requests.get(
            f"{web.url}/reprocess", params={**plan_query, **query}, auth=OPERATOR, timeout=10
        )
        assert shown.status_code == 200, shown.text
        return shown.text

    every = requests.get(
        f"{web.url}/reprocess",
        params={**plan_query, "label": "", "state": "succeeded"},
        auth=OPERATOR,
        timeout=10,
    )
    assert every.status_code == 400 and "every email is not a filter" in every.text
    planned = plan()
    assert "Reprocess 2 succeeded emails from classify?" in planned
    assert "<dt>emails</dt><dd>2</dd><dt>model calls</dt><dd>0 (rules)</dd>" in planned
    [as_of] = re.findall(r'name="as_of" value="(\d+)"', planned)
    assert re.search(r'name="expect" value="2"', planned)

    def post(**form: str) -> str:
        return redirected(web, "/reprocess", token, {**plan_query, **form})

    assert post().startswith("/reprocess?label=invoice&from=classify&in_lane=bulk")
    wrong = post(expect="3", as_of=as_of)
    assert "changed=3" in wrong
    assert (
        "It was 3 when you confirmed; it is 2 now: nothing was done."
        in requests.get(f"{web.url}{wrong}", auth=OPERATOR, timeout=10).text
    )
    assert [run_status(res, i) for i in ids] == ["succeeded"] * 2
    done = post(expect="2", as_of=as_of)
    assert done == "/search?label=invoice&action=reprocess&done=2&enqueued=2"
    assert (
        "2 reprocessed, 2 jobs sent"
        in requests.get(f"{web.url}{done}", auth=OPERATOR, timeout=10).text
    )
    assert [run_status(res, i) for i in ids] == ["open"] * 2
    # The same confirmation posted again (a second click) takes nothing, and says so.
    again = post(expect="2", as_of=as_of)
    assert "changed=2" in again
    shown = requests.get(f"{web.url}{again}", auth=OPERATOR, timeout=10).text
    assert "it is 0 now: nothing was done" in shown and 'id="confirm"' not in shown
    overview = requests.get(f"{web.url}/", auth=VIEWER, timeout=10).text
    assert 'id="reprocesses"' in overview
    with res.db.session() as session:
        assert [r["taken"] for r in reprocesses(session)] == [2]


def test_a_reprocess_past_the_ceiling_needs_its_box_ticked(res, console) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.operations.test_reprocess import OTHER
    from tests.unit.pipeline.test_job import INVOICE, PLAIN

    set_model_calls(res, True)
    ids = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    assert [job.process_email(res, i).kind.value for i in [*ids, other]] == ["succeeded"] * 3
    web = console({**os.environ, "MAILPIPE_REPROCESS_MAX": "1"})
    token = web.csrf(OPERATOR)
    form = {"label": "invoice", "from": "parse", "in_lane": "bulk"}
    planned = requests.get(f"{web.url}/reprocess", params=form, auth=OPERATOR, timeout=10).text
    assert "more than MAILPIPE_REPROCESS_MAX (1) takes at once" in planned
    assert '<input type="checkbox" name="over_max" value="yes" required>' in planned
    [as_of] = re.findall(r'name="as_of" value="(\d+)"', planned)

    def post(**more: str) -> str:
        return redirected(web, "/reprocess", token, {**form, "expect": "2", "as_of": as_of, **more})

    refused = post()
    assert refused.startswith("/reprocess?") and "changed" not in refused
    assert [run_status(res, i) for i in ids] == ["succeeded"] * 2
    assert post(over_max="yes").startswith("/search?label=invoice&action=reprocess&done=2")
    assert [run_status(res, i) for i in ids] == ["open"] * 2


def test_an_action_on_all_a_list_holds_shows_its_count_and_needs_it_back(res, console) -> None:  # type: ignore[no-untyped-def]
    """The failed list's "Retry all", and the review list's "Dismiss all" and "Clear all", go
    to a page that shows how many they take (and, for a retry, how many were rejected input,
    which fails again), with a form that posts that count back. A post without it, or with
    another count, does nothing and goes back to that page."""
    from tests.support.failed_runs import add_failed

    rejected = [add_failed(res, n, "InputRejected", review=True) for n in (1, 2)]
    stalled = add_failed(res, 3, "Stalled", review=True)
    web = console()
    token = web.csrf(OPERATOR)
    listed = requests.get(f"{web.url}/failed", auth=OPERATOR, timeout=10).text
    assert '<form id="matching" method="get" action="/failed/confirm">' in listed
    assert (
        '<button form="matching" name="do" value="retry">Retry all 3 matching…</button>' in listed
    )

    def confirm(path: str, **query: str) -> str:
        shown = requests.get(f"{web.url}{path}", params=query, auth=OPERATOR, timeout=10)
        assert shown.status_code == 200, shown.text
        return shown.text

    def post(path: str, **form: str) -> str:
        return redirected(web, path, token, form)

    page = confirm("/failed/confirm", do="retry")
    assert "Retry all 3 failed runs the filters match?" in page
    assert (
        "2 of them failed as InputRejected: their input is rejected, and a retry fails again."
        in page
    )
    assert re.search(r'name="do" value="retry-matching">.*name="expect" value="3"', page, re.S)
    narrowed = confirm("/failed/confirm", do="retry", error_class="Stalled")
    assert "None of them failed as InputRejected." in narrowed
    assert "<dt>filters</dt><dd>error_class Stalled</dd>" in narrowed

    assert post("/failed", do="retry-matching") == "/failed/confirm?do=retry"
    assert post("/failed", do="dismiss-matching") == "/failed/confirm?do=dismiss"
    assert post("/failed", do="retry-matching", expect="2") == "/failed/confirm?do=retry&changed=2"
    assert {run_status(res, i) for i in [*rejected, stalled]} == {"failed"}
    done = post("/failed", do="retry-matching", error_class="Stalled", expect="1")
    assert done == "/failed?error_class=Stalled&action=retry&done=1&enqueued=1&refused=0"
    assert run_status(res, stalled) == "open"

    review = requests.get(f"{web.url}/review", auth=OPERATOR, timeout=10).text
    assert (
        '<button form="all" name="do" value="clear" class="danger">Clear all 2 marks…</button>'
        in review
    )
    assert "Clear the mark of all 2 emails on the review list?" in confirm(
        "/review/confirm", do="clear"
    )
    assert "2 of them failed as InputRejected" in confirm("/review/confirm", do="retry")
    assert post("/review", do="clear-matching") == "/review/confirm?do=clear"
    assert (
        post("/review", do="dismiss-matching", expect="3") == "/review/confirm?do=dismiss&changed=3"
    )
    assert (
        json.loads(requests.get(f"{web.url}/api/review", auth=VIEWER, timeout=10).text)["total"]
        == 2
    )
    assert post("/review", do="clear-matching", expect="2").startswith(
        "/review?action=clear&done=2"
    )
    assert (
        json.loads(requests.get(f"{web.url}/api/review", auth=VIEWER, timeout=10).text)["total"]
        == 0
    )
    assert {run_status(res, i) for i in rejected} == {"failed"}  # cleared, not retried
    assert confirm("/review/confirm", do="retry").count('id="confirm"') == 0  # nothing to do


def test_an_email_page_counts_deferrals_and_pages_its_history(res, console) -> None:  # type: ignore[no-untyped-def]
    """A run deferred a thousand times is one line of its history; past 50 attempts, the page
    links to the ones before, and the API gives the same cursor."""
    email_id = failed_run(res)
    start = utcnow() - timedelta(hours=1)
    with res.db.transaction() as session:
        run_id = session.scalar(select(PipelineRun.id).where(PipelineRun.email_id == email_id))
        rows: list[dict[str, Any]] = [
            {
                "run_id": run_id,
                "email_id": email_id,
                "stage": "cpu",
                "attempt": 1,
                "ended_at": start + timedelta(seconds=n),
                "outcome": "retrying",
                "error_class": "OperationalError",
            }
            for n in range(60)
        ]
        rows[-1] |= {"outcome": "deferred", "error_class": "RateLimited", "deferrals": 1000}
        session.execute(insert(RunAttempt), rows)
    web = console()
    page = requests.get(f"{web.url}/emails/{email_id}", auth=VIEWER, timeout=10)
    assert page.status_code == 200
    assert re.search(
        r"1000 times, last at <time [^>]+>[^<]+</time>, because RateLimited", page.text
    )
    assert page.text.count("<tr>") - page.text.count('id="history"') >= 50
    older = re.search(r'id="older-history" href="([^"]+)"', page.text)
    assert older is not None
    before = requests.get(f"{web.url}{older.group(1)}", auth=VIEWER, timeout=10)
    assert before.status_code == 200 and 'id="older-history"' not in before.text
    api = requests.get(f"{web.url}/api/jobs/{email_id}", auth=VIEWER, timeout=10).json()
    assert len(api["history"]) == 50 and api["history"][-1]["deferrals"] == 1000
    rest = requests.get(
        f"{web.url}/api/jobs/{email_id}",
        params={"history_before": api["older_history"]},
        auth=VIEWER,
        timeout=10,
    ).json()
    assert (len(rest["history"]), rest["older_history"]) == (10, None)
    refused = requests.get(
        f"{web.url}/api/jobs/{email_id}?history_before=abc", auth=VIEWER, timeout=10
    )
    assert refused.status_code == 400
