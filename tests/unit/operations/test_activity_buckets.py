"""The activity's windows and what it counts, without a database. Pure code: no service."""

from __future__ import annotations

from datetime import datetime

import pytest

from mailpipe.operations.activity import DAY, HOUR, KINDS, OUTCOMES, TIMED, percentile
from mailpipe.operations.metrics import JOB_COUNTS
from mailpipe.storage.models import AttemptOutcome

NOW = datetime(2026, 1, 1, 12, 30, 20)


def test_each_outcome_counts_as_one_kind_as_the_metrics_report_counts_it() -> None:
    assert KINDS == ("succeeded", "failed", "retried", "deferred")
    counted = [outcome for kind in KINDS for outcome in OUTCOMES[kind]]
    assert sorted(counted) == sorted(o.value for o in AttemptOutcome)
    for kind in KINDS:
        for outcome in OUTCOMES[kind]:
            assert JOB_COUNTS[AttemptOutcome(outcome)] == f"Jobs{kind.capitalize()}"
    assert TIMED == ["duplicate", "handed_off", "succeeded", "waiting"]


def test_the_windows_buckets_end_with_the_one_under_way() -> None:
    assert HOUR.start(NOW) == datetime(2026, 1, 1, 11, 31)
    assert HOUR.start(datetime(2026, 1, 1, 12, 30)) == datetime(2026, 1, 1, 11, 31)
    assert (HOUR.buckets, HOUR.bucket_minutes) == (60, 1)
    # Quarter hours: 12:30 is the last, a day of them before it.
    assert DAY.start(NOW) == datetime(2025, 12, 31, 12, 45)
    assert DAY.start(datetime(2026, 1, 1, 12, 44, 59)) == datetime(2025, 12, 31, 12, 45)
    assert (DAY.buckets, DAY.bucket_minutes) == (96, 15)


def test_percentile_is_postgresql_s_percentile_cont() -> None:
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([1.0, 2.0], 0.5) == 1.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.9) == pytest.approx(3.7)
    assert percentile([float(s) for s in range(1, 11)], 0.9) == pytest.approx(9.1)
