from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from mailpipe.settings import Settings


def test_embedded_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("MAILPIPE_"):
            monkeypatch.delenv(name)
    settings = Settings()
    assert settings.database_url == "sqlite:///var/mailpipe.db"
    assert settings.broker_url == "redis://localhost:6379/0"
    assert settings.blob_url == "file://var/blobs"
    assert settings.model_backend == "rules"
    assert settings.worker_concurrency == 2
    assert settings.max_attempts == 4
    assert settings.soft_shutdown_timeout < 120


def test_visibility_timeout_must_cover_time_limit_and_backoff() -> None:
    with pytest.raises(ValidationError, match="VISIBILITY_TIMEOUT must exceed"):
        Settings(visibility_timeout=500, task_time_limit=300, retry_backoff_max=300)
    with pytest.raises(ValidationError, match="SOFT_TIME_LIMIT must be below"):
        Settings(task_soft_time_limit=300, task_time_limit=300)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILPIPE_MODEL_BACKEND", "bedrock")
    monkeypatch.setenv("MAILPIPE_LABELS", '["a", "b"]')
    settings = Settings()
    assert settings.model_backend == "bedrock"
    assert settings.labels == ("a", "b")
