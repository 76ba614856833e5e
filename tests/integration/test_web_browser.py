"""The console in a real browser: headless Chromium (the system's, /usr/bin/chromium) driven by
Playwright, over `mailpipe web` and a real worker.

An operator signs in (basic auth), finds the email whose raw bytes were missing in the failed
list, opens its page and reads its attempt history; the blob is put back, the operator ticks the
email and presses "Retry selected", and watches its page until the run has succeeded. Each page
is saved as console-*.png in the test's folder, or with MAILPIPE_SCREENSHOTS=docs/img where
docs/operations.md shows them (how those pictures are made).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from playwright.sync_api import ConsoleMessage, expect, sync_playwright
from sqlalchemy import insert

from mailpipe.cli.ingest import store_emails
from mailpipe.pipeline import emails
from mailpipe.storage.keys import raw_email_key
from mailpipe.storage.models import EmailMessage, utcnow
from tests.conftest import CHROMIUM
from tests.support.console import OPERATOR, ConsoleProcess, users_env
from tests.support.fleet import Fleet
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

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
    return (
        f"From: {sender}\r\nTo: ops@corp.example\r\nSubject: {subject}\r\n"
        f"Message-ID: <{os.urandom(8).hex()}@corp.example>\r\n\r\n{body}\r\n"
    ).encode()


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


def test_an_operator_retries_a_failed_email_in_a_browser(res, fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    f: Fleet = fleet()
    f.worker("console")
    web = ConsoleProcess({**f.env, **users_env()}, tmp_path / "web.log")
    try:
        delivered = store_emails(res, [email(*mail) for mail in MAIL])
        raw = email("billing@shop.example", "Invoice 2026-0190", "The invoice: amount due 40 EUR.")
        missing, key = store_without_blob(res, raw)
        f.enqueue([*delivered, missing])
        closed = wait_until_closed(res, [*delivered, missing])
        assert closed == {**dict.fromkeys(delivered, "succeeded"), missing: "failed"}
        with res.db.transaction() as session:
            emails.mark_for_review(
                session, [delivered[1]], "the model named a label out of the list"
            )
        shots = Path(os.environ.get("MAILPIPE_SCREENSHOTS") or tmp_path)
        _drive(web, missing, shots, put_back=lambda: res.blobs.put(key, raw))
    finally:
        web.stop()
    assert "ops: retry selected in the failed list, 1 emails" in web.output()


def _drive(web: ConsoleProcess, missing: int, shots: Path, put_back) -> None:  # type: ignore[no-untyped-def]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            context = browser.new_context(
                http_credentials={"username": OPERATOR[0], "password": OPERATOR[1]},
                viewport={"width": 1280, "height": 800},
            )
            page = context.new_page()
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
            page.screenshot(path=shots / "console-overview.png", full_page=True)

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
            page.screenshot(path=shots / "console-email.png", full_page=True)
            assert blocked == []
        finally:
            browser.close()
