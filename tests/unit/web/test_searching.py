"""The search slots, pure: a user's searches past their bound are refused with 429, everyone's past
theirs with 503, each with Retry-After, and a slot is given back however its search ends."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from starlette.exceptions import HTTPException

from mailpipe.web.searching import SearchSlots


def refusal(slots: SearchSlots, user: str) -> tuple[int, str | None]:
    with pytest.raises(HTTPException) as refused, slots.taken(user):
        pass
    headers = refused.value.headers or {}
    return refused.value.status_code, headers.get("Retry-After")


def test_a_user_past_their_searches_is_429_and_everyone_past_all_is_503() -> None:
    slots = SearchSlots(in_all=3, per_user=2)
    with ExitStack() as running:
        running.enter_context(slots.taken("ann"))
        running.enter_context(slots.taken("ann"))
        assert refusal(slots, "ann") == (429, "1")
        running.enter_context(slots.taken("bob"))
        assert refusal(slots, "bob") == (503, "1")
        assert refusal(slots, "ann") == (429, "1")  # their own bound is what they met first
    with slots.taken("ann"), slots.taken("ann"), slots.taken("bob"):
        pass  # all given back


def test_a_search_that_fails_gives_its_slot_back() -> None:
    slots = SearchSlots(in_all=1, per_user=1)
    with pytest.raises(RuntimeError), slots.taken("ann"):
        raise RuntimeError("the search failed")
    with slots.taken("bob"):
        assert refusal(slots, "ann") == (503, "1")
