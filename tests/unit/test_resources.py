"""Stand-ins put in the place of what `Resources` would build, for tests of the pipeline."""

from __future__ import annotations

from functools import cached_property

import pytest

from mailpipe.resources import Resources
from mailpipe.settings import Settings


def test_a_stand_in_is_the_part_and_nothing_else_is_built() -> None:
    blobs = object()
    res = Resources(Settings()).with_standins(blobs=blobs)
    assert res.blobs is blobs
    parts = {name for name, value in vars(Resources).items() if isinstance(value, cached_property)}
    assert parts & set(vars(res)) == {"blobs"}


def test_a_name_that_is_no_part_and_a_part_built_already_are_refused() -> None:
    res = Resources(Settings())
    with pytest.raises(TypeError, match="no part 'settings'"):
        res.with_standins(settings=object())
    res.pauses.forget()  # built
    with pytest.raises(ValueError, match="'pauses' is built already"):
        res.with_standins(pauses=object())
