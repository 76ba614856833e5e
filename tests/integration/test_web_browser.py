"""The console in a real browser: headless Chromium (the system's, /usr/bin/chromium) driven by
Playwright, over `mailpipe web` and a real worker.

An operator signs in (basic auth), finds the email whose raw bytes were missing in the failed
list, opens its page and reads its attempt history; the blob is put back, the operator ticks the
email and presses "Retry selected", and watches its page until the run has succeeded; then finds
an invoice by its Message-ID in the search box, both invoices by their sender, and opens one from
the results; dismisses a failed run from its email's page, finds it in the dismissed view and
takes the dismiss back; opens "Retry all" of the failed list, which says how many it takes and
how many were rejected input, and cancels; and reprocesses the 100 invoices by their label,
confirming the plan of what that takes first, watching the overview until every one is done.
The overview charts the jobs just run, and the queues as beat's metrics report read them. Each
page is saved as console-*.png in the test's folder, or with MAILPIPE_SCREENSHOTS=docs/img where
docs/console.md shows them (how those pictures are made): the overview with its charts and
the reprocess's progress, the charts alone, the failed list and its dismissed view, the review
list, the retried email's page with its attempts and actions, the search's results, a "Retry
all" confirmation and a reprocess's plan. The model stage is the Bedrock stand-in
(tests/support/bedrock_server.py), and the charts also draw an hour before the test, written
into the tables they read (`_the_hour_before`)."""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
from playwright.sync_api import ConsoleMessage, Page, expect
from sqlalchemy import func, insert, select

from mailpipe.cli.ingest import store_emails
from mailpipe.operations.activity import KINDS, OUTCOMES
from mailpipe.pipeline import emails
from mailpipe.storage import flags
from mailpipe.storage.keys import raw_email_key
from mailpipe.storage.models import EmailMessage, PipelineRun, QueueSample, RunAttempt, utcnow
from tests.support.bedrock_server import BedrockServer, keyword_labels, unlimited_bedrock_env
from tests.support.console import ConsoleProcess, users_env
from tests.support.emails import raw_email
from tests.support.fleet import Fleet
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# The invoices a reprocess takes: the backfill's, the first of MAIL and the retried one.
REPROCESSED = 100
MAIL = [
    (
        "billing@acme.example",
        "Invoice 2026-0142",
        "Please find the invoice; payment due in 30 days.",
    ),
    ("news@lists.example", "This week in storage", "Our newsletter. Unsubscribe at any time."),
    (
        "it@corp.example",
        "Security alert",
        "A sign-in attempt from a new device: reset your password.",
    ),
    ("carol@corp.example", "Lunch on Friday?", "Shall we meet at noon?"),
]


def email(sender: str, subject: str, body: str) -> bytes:
    return raw_email(
        subject,
        sender=sender,
        to="ops@corp.example",
        body=body,
        message_id=f"{os.urandom(8).hex()}@corp.example",
    )


def store_without_blob(res, raw: bytes) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """An email row whose raw bytes were never written, and the key they belong at."""
    digest = hashlib.sha256(raw).hexdigest()
    key = raw_email_key(digest)
    with res.db.transaction() as session:
        email_id = session.scalar(
            insert(EmailMessage)
            .values(blob_key=key, size=len(raw), sha256=digest, received_at=utcnow())
            .returning(EmailMessage.id)
        )
    return int(email_id), key


def test_an_operator_retries_a_failed_email_in_a_browser(  # type: ignore[no-untyped-def]
    res, fleet, tmp_path, operator_page
) -> None:
    # As long as a short call takes, so that the charts' durations read as a model's.
    model = BedrockServer(default=keyword_labels, delay=0.4).start()
    f: Fleet = fleet(MAILPIPE_METRICS_INTERVAL="1", **unlimited_bedrock_env(model, tmp_path))
    queue = f.env.get("MAILPIPE_QUEUE", res.settings.queue)
    # The worker and model roles, each on both lanes.
    f.worker("console", "-Q", f"{queue},{queue}.bulk,{queue}.control")
    f.worker("model", "-P", "threads", "-c", "8", "-Q", f"{queue}.model,{queue}.model.bulk")
    f.beat()  # its metrics report writes the lanes' samples the overview draws
    web = ConsoleProcess({**f.env, **users_env()}, tmp_path / "web.log")
    try:
        raws = [email(*mail) for mail in MAIL]
        delivered = store_emails(res, raws)
        # A backfill the operator reprocesses by its label.
        backfill = store_emails(
            res,
            [
                email(f"ap{n}@supplier.example", f"Invoice B-{n:03}", "The invoice, payment due.")
                for n in range(REPROCESSED - 2)
            ],
        )
        f.enqueue(backfill)
        raw = email("billing@shop.example", "Invoice 2026-0190", "The invoice: amount due 40 EUR.")
        missing, key = store_without_blob(res, raw)
        gone, _ = store_without_blob(res, email("ops@corp.example", "Weekly report", "Attached."))
        f.enqueue([*delivered, missing, gone])
        closed = wait_until_closed(res, [*delivered, missing, gone])
        failed = {missing: "failed", gone: "failed"}
        assert closed == {**dict.fromkeys(delivered, "succeeded"), **failed}
        assert set(wait_until_closed(res, backfill).values()) == {"succeeded"}
        with res.db.transaction() as session:
            emails.mark_for_review(
                session, [delivered[1]], "the model named a label out of the list"
            )
        shots = Path(os.environ.get("MAILPIPE_SCREENSHOTS") or tmp_path)
        invoice_id = re.search(rb"Message-ID: (<[^>]+>)", raws[0])
        assert invoice_id is not None
        search = partial(_search, invoice=delivered[0], invoice_id=invoice_id[1].decode())
        wait_for(lambda: _samples(res) >= 8, 30, "two metrics reports, a sample per lane each")
        _the_hour_before(res, backfill)
        activity = partial(_activity, attempts=_cpu_attempts_by_minute(res), shots=shots)
        _drive(
            operator_page,
            web,
            missing,
            shots,
            dismiss_and_undo=partial(_dismiss_and_undo, web=web, email_id=gone),
            retry_all=partial(_retry_all, web=web, email_id=gone),
            put_back=lambda: res.blobs.put(key, raw),
            search=search,
            activity=activity,
        )
    finally:
        web.stop()
        model.stop()
    assert f"retry by web:ops: 1 email(s): {missing}" in web.output()  # its one audit line


def _drive(
    page: Page,
    web: ConsoleProcess,
    missing: int,
    shots: Path,
    put_back,
    search,
    activity,
    dismiss_and_undo,
    retry_all,
) -> None:  # type: ignore[no-untyped-def]
    # What the Content-Security-Policy blocks, Chromium says on the console.
    blocked: list[str] = []

    def note_blocked(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            blocked.append(message.text)

    page.on("console", note_blocked)
    page.goto(f"{web.url}/")
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    expect(page.locator("header")).to_have_css("background-color", "rgb(29, 35, 48)")
    expect(page.get_by_text("console@localhost")).to_be_visible()  # the live worker
    activity(page)

    page.get_by_role("link", name="Failed", exact=True).click()
    row = page.locator("tr", has=page.locator(f'a[href="/emails/{missing}"]'))
    expect(row).to_contain_text("BlobMissing")
    select_all = page.get_by_label("select all on this page")
    select_all.check()
    expect(page.get_by_label(f"select email {missing}")).to_be_checked()
    select_all.uncheck()
    expect(page.get_by_label(f"select email {missing}")).not_to_be_checked()
    page.screenshot(path=shots / "console-failed.png", full_page=True)

    row.get_by_role("link", name=str(missing)).click()
    expect(page.locator("#state")).to_have_text("failed")
    expect(page.locator("#history")).to_contain_text("BlobMissing")
    first_attempts = page.locator("#history tr").count() - 1  # less the heading
    assert first_attempts >= 1

    page.get_by_role("link", name="Review", exact=True).click()
    expect(page.get_by_text("the model named a label out of the list")).to_be_visible()
    page.screenshot(path=shots / "console-review.png", full_page=True)

    put_back()
    page.get_by_role("link", name="Failed", exact=True).click()
    page.get_by_label(f"select email {missing}").check()
    page.get_by_role("button", name="Retry selected").click()
    expect(page.get_by_role("status")).to_have_text("1 retried, 1 jobs sent")

    page.goto(f"{web.url}/emails/{missing}")

    def succeeded() -> bool:
        page.reload()
        return page.locator("#state").inner_text() == "succeeded"

    wait_for(succeeded, 60, "the email's page to show its run succeeded", every=0.5)
    assert page.locator("#history tr").count() - 1 > first_attempts
    expect(page.locator("#history")).to_contain_text("succeeded")
    expect(page.get_by_role("button", name="Reprocess", exact=True)).to_be_visible()
    page.screenshot(path=shots / "console-email.png", full_page=True)
    search(page, retried=missing, shots=shots)
    dismiss_and_undo(page, shots=shots)
    retry_all(page, shots=shots)
    _reprocess(page, web, shots)
    assert blocked == []


def _search(page: Page, invoice: int, invoice_id: str, retried: int, shots: Path) -> None:
    """The operator finds the first invoice by its Message-ID, then both invoices by their
    sender (the retried one too, now that its job has read it), and opens one from the results;
    an id typed in the box opens its email at once."""
    box = page.get_by_role("searchbox", name="search emails")
    box.fill(invoice_id.upper())
    box.press("Enter")
    expect(page.get_by_role("heading", name="Search")).to_be_visible()
    results = page.locator("#results tr")
    expect(results).to_have_count(2)  # the heading and the one email
    expect(page.locator("#results")).to_contain_text("Invoice 2026-0142")

    box.fill("billing@")
    box.press("Enter")
    expect(results).to_have_count(3)
    expect(results.nth(1)).to_contain_text("Invoice 2026-0190")  # the newest first
    expect(results.nth(1)).to_contain_text("succeeded")
    expect(results.nth(2)).to_contain_text("billing@acme.example")
    page.get_by_label("state").select_option("succeeded")
    page.get_by_role("button", name="Search").click()
    expect(page.get_by_label("sender")).to_have_value("billing@")
    expect(results).to_have_count(3)
    page.screenshot(path=shots / "console-search.png", full_page=True)

    page.get_by_role("link", name=str(invoice), exact=True).click()
    expect(page.get_by_role("heading", name=f"Email {invoice}")).to_be_visible()
    expect(page.locator("#state")).to_have_text("succeeded")

    box.fill(str(retried))
    box.press("Enter")
    expect(page.get_by_role("heading", name=f"Email {retried}")).to_be_visible()


def _the_hour_before(res, email_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """The fifty minutes before the test, so that the charts draw a fleet at work rather than
    the one minute the test's own jobs take (the pictures in docs/console.md): each stage's
    attempts, as the workers write them, on the runs of `email_ids`; each lane's readings, as
    the metrics report writes them, the model's throttled deferrals among them; and a backfill
    in the bulk lane between 40 and 20 minutes ago."""
    draw = random.Random(7)
    now = utcnow()
    with res.db.session() as session:
        run_of = dict(
            session.execute(
                select(PipelineRun.email_id, PipelineRun.id).where(
                    PipelineRun.email_id.in_(email_ids)
                )
            ).all()
        )
    attempts: list[dict[str, object]] = []
    samples: list[dict[str, object]] = []
    cpu, model = res.settings.queue, f"{res.settings.queue}.model"
    for ago in range(50, 1, -1):
        minute = now - timedelta(minutes=ago)
        backfill = 20 <= ago <= 40
        for n in range(int(30 + 10 * math.sin(ago / 5)) + (45 if backfill else 0)):
            email_id = email_ids[n % len(email_ids)]
            handed_off = minute + timedelta(seconds=draw.uniform(0, 55))
            answered = handed_off + timedelta(seconds=draw.lognormvariate(math.log(0.45), 0.2))
            cpu_failed = draw.random() < 0.02
            for stage, ended, seconds, outcome in (
                ("cpu", handed_off, draw.lognormvariate(math.log(0.05), 0.4), "handed_off"),
                ("model", answered, (answered - handed_off).total_seconds(), "succeeded"),
            ):
                if stage == "model" and cpu_failed:
                    continue
                attempts.append(
                    {
                        "run_id": run_of[email_id],
                        "email_id": email_id,
                        "stage": stage,
                        "attempt": 1,
                        "started_at": ended - timedelta(seconds=seconds),
                        "ended_at": ended,
                        "outcome": "retrying" if cpu_failed else outcome,
                        "error_class": "OperationalError" if cpu_failed else None,
                        "host": f"{stage}-1",
                    }
                )
        # The backfill drains while its oldest job waits longer and longer.
        bulk, waited = ((ago - 19) * 60, (40 - ago) * 60 + 30.0) if backfill else (0, 0.0)
        for queue, lane, depth, oldest, deferred in (
            (cpu, "live", draw.randint(0, 12), draw.uniform(0, 3), 0),
            (cpu, "bulk", bulk, waited, 0),
            (model, "live", draw.randint(0, 6), draw.uniform(0, 2), 0),
            (model, "bulk", bulk // 20, waited / 20, draw.choice((0, 0, 2, 5))),
        ):
            samples.append(
                {
                    "measured_at": minute + timedelta(seconds=30),
                    "queue": queue,
                    "lane": lane,
                    "depth": depth,
                    "oldest_age_s": oldest,
                    "deferred": deferred,
                }
            )
    with res.db.transaction() as session:
        session.execute(insert(RunAttempt), attempts)
        session.execute(insert(QueueSample), samples)


def _samples(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalar(select(func.count()).select_from(QueueSample)) or 0


def _cpu_attempts_by_minute(res) -> dict[str, dict[str, int]]:  # type: ignore[no-untyped-def]
    """The CPU stage's attempts of the hour by the minute they ended in (HH:MM, UTC), by kind."""
    kind_of = {outcome: kind for kind, outcomes in OUTCOMES.items() for outcome in outcomes}
    found: dict[str, dict[str, int]] = {}
    with res.db.session() as session:
        for outcome, ended_at in session.execute(
            select(RunAttempt.outcome, RunAttempt.ended_at).where(RunAttempt.stage == "cpu")
        ):
            minute = found.setdefault(ended_at.strftime("%H:%M"), dict.fromkeys(KINDS, 0))
            minute[kind_of[outcome]] += 1
    return found


def _activity(page: Page, attempts: dict[str, dict[str, int]], shots: Path) -> None:
    """The overview charts the jobs just run: the CPU stage's totals over the hour above its
    charts, each minute's succeeded attempts in the table beside them (opened with no script)
    and in the titles of the bars; the queues as the metrics report read them; and the last
    day, a link away, with the same totals."""
    cpu = page.locator("#activity-cpu")
    totals = {kind: sum(minute[kind] for minute in attempts.values()) for kind in KINDS}
    assert totals["succeeded"] > 0, attempts

    def shows_the_totals() -> None:
        for kind, n in totals.items():
            expect(cpu.locator(".summary span", has_text=kind)).to_have_text(f"{n:,} {kind}")

    shows_the_totals()
    expect(cpu.locator("svg")).to_have_count(2)  # attempts a minute, durations
    cpu.get_by_text("The figures").click()
    for minute, kinds in attempts.items():
        row = cpu.locator("tr", has=page.get_by_role("cell", name=minute, exact=True))
        expect(row.locator("td").nth(1)).to_have_text(str(kinds["succeeded"]))
        if kinds["succeeded"]:
            bar = cpu.locator("svg g.column > title", has_text=f"{minute}: {kinds['succeeded']} ")
            expect(bar).to_have_count(1)
    cpu.get_by_text("The figures").click()  # closed again for the screenshot
    queues = page.locator("#activity-queues")
    expect(queues.locator(".summary span", has_text="mailpipe.bulk")).to_contain_text("waiting")
    expect(queues.locator("svg polyline").first).to_be_attached()

    page.get_by_role("link", name="Last day").click()
    expect(page.get_by_role("link", name="Last day")).to_have_attribute("aria-current", "page")
    shows_the_totals()
    page.get_by_role("link", name="Last hour").click()
    expect(page.get_by_role("link", name="Last hour")).to_have_attribute("aria-current", "page")
    page.locator(".panels").screenshot(path=shots / "console-activity.png")


def _dismiss_and_undo(page: Page, web: ConsoleProcess, email_id: int, shots: Path) -> None:
    """The operator dismisses a run from its email's page, finds it in the failed list's
    dismissed view, and takes the dismiss back from there."""
    page.goto(f"{web.url}/emails/{email_id}")
    page.get_by_role("button", name="Dismiss", exact=True).click()
    expect(page.get_by_role("status")).to_have_text("1 dismissed")
    page.get_by_role("link", name="Failed", exact=True).click()
    expect(page.locator(f'a[href="/emails/{email_id}"]')).to_have_count(0)
    page.get_by_role("link", name="dismissed", exact=True).click()
    expect(page.get_by_role("heading", name="Dismissed runs")).to_be_visible()
    expect(page.locator(f'a[href="/emails/{email_id}"]')).to_have_count(1)
    page.screenshot(path=shots / "console-dismissed.png", full_page=True)
    page.get_by_label(f"select email {email_id}").check()
    page.get_by_role("button", name="Undo dismiss of selected").click()
    expect(page.get_by_role("status")).to_have_text("1 back on the failed list")
    page.get_by_role("link", name="on the list", exact=True).click()
    expect(page.locator(f'a[href="/emails/{email_id}"]')).to_have_count(1)


def _reprocess(page: Page, web: ConsoleProcess, shots: Path) -> None:
    """The operator searches the invoices by their label and presses "Reprocess…": its plan
    says how many emails it takes and the model calls that costs, and nothing is taken until
    the operator confirms it there; then the overview follows it until every one is done."""
    page.goto(f"{web.url}/search?label=invoice&state=succeeded")
    page.get_by_label("reprocess from").select_option("documents")
    page.get_by_role("button", name="Reprocess…").click()
    expect(page.get_by_role("heading")).to_have_text(
        f"Reprocess {REPROCESSED} succeeded emails from documents?"
    )
    figures = page.locator("#figures")
    expect(figures).to_contain_text(f"model calls{REPROCESSED} (bedrock)")
    expect(figures).to_contain_text("filtersstate succeeded, label invoice")
    page.screenshot(path=shots / "console-reprocess-plan.png")
    page.get_by_role("button", name=f"Reprocess {REPROCESSED} emails").click()
    expect(page.get_by_role("status")).to_have_text(
        f"{REPROCESSED} reprocessed, {REPROCESSED} jobs sent"
    )

    def all_done() -> bool:
        page.goto(f"{web.url}/")  # a new load each time: a fragment alone would not reload
        cells = page.locator("#reprocesses + table tr").nth(1).locator("td")
        done, left = cells.nth(7).inner_text(), cells.nth(9).inner_text()
        return done == str(REPROCESSED) and left == "0"

    wait_for(all_done, 120, "the reprocess to reach every email", every=1.0)
    expect(page.locator("#activity-cpu svg")).to_have_count(2)
    page.screenshot(path=shots / "console-overview.png", full_page=True)


def test_the_overview_says_model_calls_are_off_and_how_many_runs_wait(  # type: ignore[no-untyped-def]
    res, fleet, tmp_path, operator_page
) -> None:
    """A new operator's first fleet, as the README runs it: model calls start off, so the emails
    stop past their CPU stage. The overview says so at its top, with the count, and switching
    them on from it ends the wait."""
    f: Fleet = fleet()
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    f.worker("cpu")
    web = ConsoleProcess({**f.env, **users_env()}, tmp_path / "web.log")
    shots = Path(os.environ.get("MAILPIPE_SCREENSHOTS") or tmp_path)
    try:
        ids = store_emails(res, [email(*mail) for mail in MAIL])
        f.enqueue(ids)
        wait_for(lambda: _waiting(res) == len(ids), 60, "every run waiting for model calls")
        page = operator_page
        page.goto(f"{web.url}/")
        banner = page.locator("#model-calls-off")
        expect(banner).to_be_visible()
        expect(banner).to_contain_text(f"Model calls are off: {len(ids)} runs wait")
        page.screenshot(path=shots / "console-model-calls-off.png")
        banner.get_by_role("link", name="Model calls").click()
        page.get_by_role("button", name="Switch model calls on").click()
        expect(page.locator("#model-calls-off")).to_have_count(0)
        assert set(wait_until_closed(res, ids).values()) == {"succeeded"}
    finally:
        web.stop()


def _waiting(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalar(
            select(func.count()).where(
                PipelineRun.status == "open", PipelineRun.waiting_since.is_not(None)
            )
        )


def _retry_all(page: Page, web: ConsoleProcess, email_id: int, shots: Path) -> None:
    """The failed list's "Retry all" shows how many runs it takes, and of them how many were
    rejected input, which a retry fails again; the operator cancels, and nothing changed."""
    page.goto(f"{web.url}/failed")
    page.get_by_role("button", name="Retry all 1 matching…").click()
    expect(page.get_by_role("heading")).to_have_text("Retry all 1 failed runs the filters match?")
    expect(page.locator("#rejections")).to_have_text("None of them failed as InputRejected.")
    expect(page.get_by_role("button", name="Retry 1 runs")).to_be_visible()
    page.screenshot(path=shots / "console-confirm.png")
    page.get_by_role("link", name="Cancel").click()
    expect(page.get_by_role("heading", name="Failed runs")).to_be_visible()
    expect(page.locator(f'a[href="/emails/{email_id}"]')).to_have_count(1)
