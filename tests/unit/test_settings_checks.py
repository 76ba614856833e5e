"""The cross-checks of mailpipe/settings.py: windows that contradict each other are refused at
start with the settings named; windows that only defeat a mechanism are warnings a worker logs.
(The checks that were there before, visibility against the hard limit and backoff, dead_after
against the heartbeat, dedup against the sweep, soft below hard: tests/unit/test_settings.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from mailpipe.settings import Settings


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The production defaults, not the test suite's short windows."""
    for name in list(os.environ):
        if name.startswith("MAILPIPE_"):
            monkeypatch.delenv(name)


def test_the_defaults_pass_every_check_and_warn_of_nothing() -> None:
    settings = Settings()
    assert settings.window_warnings() == []
    assert settings.database_tls_warnings() == []
    assert settings.log_format == "text"
    assert settings.worker_health_file == Path("/tmp/mailpipe-worker.health")
    assert settings.beat_health_file == Path("/tmp/mailpipe-beat.health")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"retry_backoff_base": 30, "retry_backoff_max": 20},
            r"MAILPIPE_RETRY_BACKOFF_BASE \(30 s\) must not exceed MAILPIPE_RETRY_BACKOFF_MAX "
            r"\(20 s\)",
        ),
        (
            {"lease_ttl": 3600, "max_deferral": 3600},
            r"MAILPIPE_LEASE_TTL \(3600 s\) must be below MAILPIPE_MAX_DEFERRAL \(3600 s\)",
        ),
        ({"labels": ()}, "MAILPIPE_LABELS must name at least one label"),
        ({"labels": ("spam", " ")}, "MAILPIPE_LABELS must name at least one label, none of"),
        ({"labels": ("spam", "ham", "spam")}, "MAILPIPE_LABELS names spam more than once"),
        (
            {"web_searches": 2, "web_searches_per_user": 3},
            r"MAILPIPE_WEB_SEARCHES_PER_USER \(3\) must not exceed MAILPIPE_WEB_SEARCHES \(2\)",
        ),
    ],
)
def test_contradicting_settings_are_refused_with_their_names(values: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**values)


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("sentinel://:secret@10.0.0.5:26379/0;sentinel://10.0.0.6:26379/0", "sentinel://"),
        ("unix:///var/run/redis.sock", "unix://"),
        ("redis+socket:///var/run/redis.sock", "redis+socket://"),
        ("localhost:6379", "localhost://"),
    ],
)
def test_a_broker_url_that_redis_py_or_kombu_cannot_read_is_refused(url: str, scheme: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(broker_url=url)
    (error,) = refused.value.errors()
    assert error["msg"].startswith(
        f"Value error, MAILPIPE_BROKER_URL must be a redis:// or rediss:// URL, not {scheme}: "
    )
    assert "from_url cannot follow a Sentinel" in error["msg"]
    assert "secret" not in error["msg"]


@pytest.mark.parametrize(
    "url", ["redis://localhost:6379/0", "rediss://:secret@broker.example:6380/0?ssl_ca_certs=/ca"]
)
def test_redis_and_rediss_broker_urls_are_taken(url: str) -> None:
    assert Settings(broker_url=url).broker_url == url


def test_a_contradiction_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILPIPE_LEASE_TTL", "7200")
    with pytest.raises(ValidationError, match="MAILPIPE_LEASE_TTL"):
        Settings()


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (
            {
                "worker_dead_after": 60,
                "visibility_timeout": 60,
                "task_time_limit": 20,
                "task_soft_time_limit": 10,
                "retry_backoff_base": 10,
                "retry_backoff_max": 30,
                "defer_max": 10,
                "lease_ttl": 10,
            },
            ["MAILPIPE_WORKER_DEAD_AFTER (60 s) is not below MAILPIPE_VISIBILITY_TIMEOUT (60 s)"],
        ),
        (
            {"lease_ttl": 300},
            ["MAILPIPE_LEASE_TTL (300 s) is not below MAILPIPE_TASK_TIME_LIMIT (300 s)"],
        ),
        (
            {"lease_ttl": 1800, "max_deferral": 7200},
            [
                "MAILPIPE_LEASE_TTL (1800 s) is not below MAILPIPE_TASK_TIME_LIMIT (300 s)",
                "MAILPIPE_LEASE_TTL (1800 s) is not below MAILPIPE_VISIBILITY_TIMEOUT (1800 s)",
            ],
        ),
    ],
)
def test_windows_that_defeat_a_mechanism_are_warned_of(values: dict, named: list[str]) -> None:
    warnings = Settings(**values).window_warnings()
    assert [w.split(":")[0] for w in warnings] == named


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://mailpipe@db.internal:5432/mailpipe",
        "postgresql+psycopg://mailpipe:secret@10.0.3.7/mailpipe?sslmode=prefer",
        "postgres://mailpipe@mailpipe.abc123.us-east-1.rds.amazonaws.com/mailpipe?sslmode=allow",
    ],
)
def test_a_remote_postgresql_without_tls_required_is_warned_of(url: str) -> None:
    (warning,) = Settings(database_url=url).database_tls_warnings()
    assert warning.startswith("MAILPIPE_DATABASE_URL reaches PostgreSQL at ")
    assert "sslmode=verify-full" in warning and "secret" not in warning


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://mailpipe@db.internal/mailpipe?sslmode=require",
        "postgresql://mailpipe@db.internal/mailpipe?sslmode=verify-ca&sslrootcert=/ca.pem",
        "postgresql://mailpipe@db.internal/mailpipe?sslrootcert=/ca.pem&sslmode=verify-full",
        "postgresql://postgres@127.0.0.1:5432/mailpipe",
        "postgresql://postgres@localhost/mailpipe",
        "postgresql://postgres@[::1]/mailpipe",
        "postgresql:///mailpipe?host=/var/run/postgresql",
        "sqlite:///var/mailpipe.db",
    ],
)
def test_tls_required_loopback_or_a_socket_is_not_warned_of(url: str) -> None:
    assert Settings(database_url=url).database_tls_warnings() == []


def test_log_format_and_health_files_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MAILPIPE_LOG_FORMAT", "json")
    monkeypatch.setenv("MAILPIPE_WORKER_HEALTH_FILE", "/run/w")
    settings = Settings()
    assert settings.log_format == "json" and settings.worker_health_file == Path("/run/w")
    monkeypatch.setenv("MAILPIPE_LOG_FORMAT", "yaml")
    with pytest.raises(ValidationError, match="log_format"):
        Settings()
