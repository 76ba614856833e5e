from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from mailpipe.settings import LONGEST_S, Settings


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


def test_production_windows_default_to_the_documented_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The values docs/settings.md and docs/sweeper.md state, and the reasons they rest on."""
    for name in list(os.environ):
        if name.startswith("MAILPIPE_"):
            monkeypatch.delenv(name)
    s = Settings()
    assert (s.sweep_interval, s.stall_after, s.max_sweeps) == (300, 1800, 3)
    assert (s.visibility_timeout, s.task_soft_time_limit, s.task_time_limit) == (1800, 240, 300)
    assert (s.retry_backoff_base, s.retry_backoff_max, s.max_retries) == (200, 900, 3)
    # The least of each backoff is half its ceiling: the 3 retries span at least 10 minutes.
    ceilings = [min(s.retry_backoff_max, s.retry_backoff_base * 2**i) for i in range(s.max_retries)]
    assert sum(c / 2 for c in ceilings) >= 600
    assert (s.defer_base, s.defer_max, s.outage_alarm_after) == (5, 60, 900)
    assert (s.lease_ttl, s.dedup_ttl, s.max_deferral) == (30, 3600, 3600)
    assert (s.worker_heartbeat_interval, s.worker_dead_after) == (10, 30)
    assert (s.db_connect_timeout, s.db_statement_timeout) == (5, 30)
    # The rule the windows keep: nothing the broker holds is redelivered while it may still run.
    assert s.visibility_timeout > s.task_time_limit + s.retry_backoff_max
    assert s.soft_shutdown_timeout < 120  # inside ECS's stopTimeout


def test_beat_fires_the_sweep_at_its_interval_and_each_task_has_its_queue() -> None:
    from mailpipe.app import config

    # The fleet's metrics are no task: beat's lock holder reports them itself.
    assert config.beat_schedule == {"sweep": {"task": "mailpipe.sweep", "schedule": 300.0}}
    assert config.task_routes == {
        "mailpipe.sweep": {"queue": "mailpipe.control"},
        "mailpipe.classify_email": {"queue": "mailpipe.model"},
    }


def test_inconsistent_windows_are_refused_at_start_with_the_settings_named() -> None:
    with pytest.raises(ValidationError, match="WORKER_DEAD_AFTER must be at least twice"):
        Settings(worker_heartbeat_interval=10, worker_dead_after=15)
    with pytest.raises(ValidationError, match="DEDUP_TTL must be at least twice"):
        Settings(dedup_ttl=300, sweep_interval=300)


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


@pytest.mark.parametrize("days", ["1e6", "inf", "nan", "3651", "0"])
def test_a_retention_past_ten_years_or_not_a_number_is_refused(
    days: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepted, it would put every housekeeping pass's cut-off before year 1 (OverflowError)."""
    monkeypatch.setenv("MAILPIPE_KEEP_ATTEMPTS_DAYS", days)
    with pytest.raises(ValidationError, match="keep_attempts_days"):
        Settings()


def test_a_retention_of_ten_years_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILPIPE_KEEP_ATTEMPTS_DAYS", "3650")
    assert Settings().keep_attempts_days == 3650


# Every window, wait and interval, in seconds: datetime arithmetic, Redis's expiries and
# libpq's options each overflow somewhere past ten years.
SECONDS = (
    "model_slot_wait",
    "model_calls_cache_seconds",
    "visibility_timeout",
    "task_soft_time_limit",
    "task_time_limit",
    "retry_backoff_base",
    "retry_backoff_max",
    "lease_ttl",
    "dedup_ttl",
    "max_deferral",
    "defer_base",
    "defer_max",
    "pause_window",
    "pause_probe_interval",
    "outage_alarm_after",
    "health_cache_seconds",
    "worker_heartbeat_interval",
    "worker_dead_after",
    "db_connect_timeout",
    "soft_shutdown_timeout",
    "doc_time_limit",
    "sweep_interval",
    "stall_after",
    "beat_lock_timeout",
    "housekeeping_interval",
    "metrics_interval",
)


@pytest.mark.parametrize("name", SECONDS)
def test_no_window_is_longer_than_ten_years(name: str) -> None:
    with pytest.raises(ValidationError, match=f"{name}\n  Input should be less than or equal"):
        Settings(**{name: LONGEST_S + 1})


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    "name", sorted(name for name, f in Settings.model_fields.items() if f.annotation is float)
)
def test_no_float_setting_takes_infinity_or_nan(name: str, value: str) -> None:
    with pytest.raises(ValidationError, match=f"{name}\n  Input should be a finite number"):
        Settings(**{name: value})


@pytest.mark.parametrize(
    ("name", "most"), [("db_statement_timeout", 2_000_000), ("db_keepalives_idle", 32767)]
)
def test_the_database_timeouts_stay_within_what_libpq_and_linux_take(name: str, most: int) -> None:
    assert getattr(Settings(**{name: most}), name) == most
    with pytest.raises(ValidationError, match=name):
        Settings(**{name: most + 1})


def test_a_mailboxs_model_rate_is_its_own_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILPIPE_MAILBOX_MODEL_RATE", "4")
    monkeypatch.setenv("MAILPIPE_MAILBOX_MODEL_RATES", '{"acme": 2.5, "default": 0, "x=y,z": 1}')
    settings = Settings()
    assert settings.mailbox_model_rate_of("acme") == 2.5
    assert settings.mailbox_model_rate_of("x=y,z") == 1  # any name a mailbox may have
    assert settings.mailbox_model_rate_of("default") == 0  # no ceiling for that one
    assert settings.mailbox_model_rate_of("other") == 4
    assert Settings(mailbox_model_rate=0).mailbox_model_rate_of("other") == 0  # no ceiling


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('{"acme": 2, "secret-customer": -1}', "entry 2's rate is not a number"),
        ('{"secret-customer": "2"}', "entry 1's rate is not a number"),
        ('{"secret-customer": true}', "entry 1's rate is not a number"),
        ('{" ": 2}', "entry 1's mailbox name is empty"),
        ('["secret-customer"]', "must be a JSON object of mailbox names"),
    ],
)
def test_a_bad_mailbox_model_rate_is_refused_without_naming_the_mailbox(
    monkeypatch: pytest.MonkeyPatch, value: str, reason: str
) -> None:
    monkeypatch.setenv("MAILPIPE_MAILBOX_MODEL_RATES", value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert reason in str(refused.value)
    assert "secret-customer" not in str(refused.value)


def test_model_batches_are_on_by_default_with_the_bedrock_backend_and_a_role_only() -> None:
    role = "arn:aws:iam::123456789012:role/mailpipe-model-batch"
    assert not Settings().model_batch_on
    assert not Settings(model_backend="bedrock").model_batch_on
    assert Settings(model_backend="bedrock", model_batch_role_arn=role).model_batch_on
    assert not Settings(
        model_backend="bedrock", model_batch_role_arn=role, model_batch="off"
    ).model_batch_on
    assert Settings(model_backend="bedrock", model_batch="on").model_batch_on
    with pytest.raises(ValidationError, match="MODEL_BATCH=on needs MAILPIPE_MODEL_BACKEND"):
        Settings(model_batch="on")


def test_beat_s_leader_needs_s3_blobs_and_a_role_for_model_batches() -> None:
    on = {"model_backend": "bedrock", "model_batch": "on"}
    local = Settings(**on, blob_url="file://var/blobs")
    assert "s3:// MAILPIPE_BLOB_URL" in (local.model_batch_leader_problem() or "")
    no_role = Settings(**on, blob_url="s3://bucket/mail")
    assert "MAILPIPE_MODEL_BATCH_ROLE_ARN" in (no_role.model_batch_leader_problem() or "")
    ready = Settings(**on, blob_url="s3://bucket/mail", model_batch_role_arn="arn:aws:iam::1:r/b")
    assert ready.model_batch_leader_problem() is None
    assert Settings().model_batch_leader_problem() is None  # batches off: nothing to lead


def test_a_batch_size_outside_the_record_limits_is_refused() -> None:
    with pytest.raises(ValidationError, match="MODEL_BATCH_SIZE must be from"):
        Settings(model_batch_size=50, model_batch_min=100)
    with pytest.raises(ValidationError, match="MODEL_BATCH_SIZE must be from"):
        Settings(model_batch_size=60_000)
