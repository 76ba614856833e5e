"""The search as the console's page and the API run it: in a slot of the user's, on connections
of its own (`Resources.searches`), each statement under the web role's read timeout.

A search's cost is its data's, and the data is an outsider's: the slots bound how many run at
once, so that a flood of searches holds neither every connection of the web process nor the
database's CPUs. Past MAILPIPE_WEB_SEARCHES_PER_USER of one user's, a search is refused with 429,
past MAILPIPE_WEB_SEARCHES in all with 503, both at once and with Retry-After: a search waiting
for a slot would hold a thread and its client for as long as the others take. The slots are this
process's (a console of several tasks bounds each task's).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.exceptions import HTTPException
from starlette.requests import Request

from mailpipe.operations.search import EmailFilter, Found, find

# A search takes milliseconds (docs/benchmarks.md, "Search"): a slot is most likely free within
# a second.
RETRY_AFTER_S = 1


class SearchSlots:
    """The searches running in this process, per user; taken and given back on any thread."""

    def __init__(self, in_all: int, per_user: int) -> None:
        self._in_all = in_all
        self._per_user = per_user
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    @contextmanager
    def taken(self, user: str) -> Iterator[None]:
        """One slot of `user`'s for the block; HTTPException 429 or 503 when there is none."""
        with self._lock:
            if self._running[user] >= self._per_user:
                raise _refused(429, f"{self._per_user} searches of yours are running")
            if self._running.total() >= self._in_all:
                raise _refused(503, f"{self._in_all} searches are running")
            self._running[user] += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[user] -= 1
                if not self._running[user]:
                    del self._running[user]


def _refused(status: int, why: str) -> HTTPException:
    return HTTPException(
        status,
        f"{why}, as many as run at once: try again in {RETRY_AFTER_S} s",
        {"Retry-After": str(RETRY_AFTER_S)},
    )


def found(request: Request, filt: EmailFilter, before: int | None) -> Found:
    """`search.find`'s page for `filt` below `before`, in a slot of the signed-in user's."""
    state = request.app.state
    with (
        state.search_slots.taken(request.user.username),
        state.resources.searches.reading() as session,
    ):
        return find(session, filt, before)
