from __future__ import annotations

import pytest

from tests.support.corpus import CorpusFile, parse_corpus


@pytest.fixture(scope="session")
def parsed_corpus() -> list[CorpusFile]:
    """The corpus parsed once for the tests that each read all of it."""
    return parse_corpus()
