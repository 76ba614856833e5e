"""A real prefork worker, shared by the tests of one module that only need one to be running;
fleets of a test's own; and a browser signed in to the console.

Module scope, not session: a module that asserts what waits in the queue (the sweeper's tests)
must not have a worker from an earlier module consuming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, sync_playwright

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.fleet import CeleryProcess
from tests.conftest import CHROMIUM
from tests.support.console import OPERATOR
from tests.support.database import clean
from tests.support.fleet import Fleet


@pytest.fixture(scope="module")
def worker(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryProcess]:
    from mailpipe.resources import get_resources

    # On an earlier module's leftovers, the worker's start-up sweep would enqueue their emails,
    # and the jobs would run on the first test's emails of the same ids.
    clean(get_resources())
    process = localfleet.worker(
        dict(os.environ), tmp_path_factory.mktemp("worker-logs"), concurrency=2, name="shared"
    ).start()
    process.wait_ready()
    yield process
    process.stop()


@pytest.fixture
def live_worker(worker: CeleryProcess) -> CeleryProcess:
    """The shared worker, checked alive before and after the test."""
    assert worker.alive(), worker.log_tail()
    yield worker
    assert worker.alive(), f"the worker died during the test:\n{worker.log_tail()}"


@pytest.fixture
def fleet(res, tmp_path):  # type: ignore[no-untyped-def]
    """Makes fleets of workers of the test's own (tests/support/fleet.py), stopped after it."""
    fleets: list[Fleet] = []

    def make(**settings: str) -> Fleet:
        fleets.append(Fleet(res, tmp_path, **settings))
        return fleets[-1]

    yield make
    for made in fleets:
        made.stop()


@pytest.fixture
def operator_page() -> Iterator[Page]:
    """A page of headless Chromium (the system's, `CHROMIUM`) that signs in to the console as
    the operator, 1280 by 800 as docs/console.md's pictures are; the browser is closed after
    the test."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            context = browser.new_context(
                http_credentials={"username": OPERATOR[0], "password": OPERATOR[1]},
                viewport={"width": 1280, "height": 800},
            )
            yield context.new_page()
        finally:
            browser.close()
