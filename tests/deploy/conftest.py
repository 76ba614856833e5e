"""The deploy checks read files only: they need none of the services tests/conftest.py starts."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def services() -> None:
    """Replaces the suite-wide fixture of that name here: no Redis, PostgreSQL or S3."""
