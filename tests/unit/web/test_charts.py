"""The overview's charts as shapes, from an activity built by hand. Pure code: no service."""

from __future__ import annotations

from datetime import datetime

from mailpipe.broker.queues import Stage
from mailpipe.operations.activity import DAY, HOUR, KINDS, Activity, LaneSeries, StageSeries
from mailpipe.web import charts
from mailpipe.web.charts import BOTTOM, HEIGHT, TOP, nice_seconds, number, panels, seconds

START = datetime(2026, 1, 1, 11, 31)
PLOT = HEIGHT - BOTTOM - TOP  # the plot's height in the viewBox


def stage(**jobs: dict[int, int]) -> StageSeries:
    counts = {kind: [0] * 60 for kind in KINDS}
    for kind, at in jobs.items():
        for i, n in at.items():
            counts[kind][i] = n
    return StageSeries(jobs=counts, p50_s=[None] * 60, p90_s=[None] * 60)


def hour(cpu: StageSeries, lanes: list[LaneSeries] | None = None) -> Activity:
    return Activity(HOUR, START, {Stage.CPU: cpu, Stage.MODEL: stage()}, lanes or [])


def test_a_minute_s_bar_stacks_its_kinds_on_a_scale_that_holds_the_tallest() -> None:
    [cpu, model, queues] = panels(hour(stage(succeeded={59: 6, 10: 1}, failed={59: 2})))
    jobs = cpu.charts[0]
    assert [tick.label for tick in jobs.y_ticks] == ["0", "5", "10"]  # 8 a minute at most
    first, last = jobs.columns
    assert last.title == "12:30: 6 succeeded, 2 failed, 0 retried, 0 deferred a minute"
    succeeded, failed = last.rects
    assert (succeeded.kind, failed.kind) == ("succeeded", "failed")
    assert succeeded.height == round(6 / 10 * PLOT, 1) and failed.height == round(2 / 10 * PLOT, 1)
    assert succeeded.y + succeeded.height == HEIGHT - BOTTOM  # on the axis
    assert failed.y + failed.height == succeeded.y  # on top of it
    assert first.rects[0].x < last.rects[0].x
    assert [tick.label for tick in jobs.x_ticks] == [
        "11:40",
        "11:50",
        "12:00",
        "12:10",
        "12:20",
        "12:30",
    ]
    assert cpu.summary == [("7", "succeeded"), ("2", "failed"), ("0", "retried"), ("0", "deferred")]
    assert [row.time for row in cpu.rows] == ["12:30", "11:41"]  # the latest first
    assert cpu.rows[0].cells == ["6", "2", "0", "0", "", ""]
    assert model.rows == [] and queues.rows == [] and queues.summary == []


def test_a_lane_s_line_breaks_where_no_report_read_it() -> None:
    depth: list[int | None] = [None] * 60
    depth[10:13] = [4, 0, 2]
    depth[20] = 9
    age: list[float | None] = [None if d is None else float(d) * 10 for d in depth]
    lane = LaneSeries("mailpipe", "bulk", depth, age, [0] * len(depth))
    queues = panels(hour(stage(), [lane]))[-1]
    [line] = queues.charts[0].lines
    assert line.label == "mailpipe.bulk" and len(line.points) == 4
    assert [len(segment.split()) for segment in line.segments] == [3, 1]
    assert line.points[-1].title == "11:51: mailpipe.bulk 9"
    assert [tick.label for tick in queues.charts[0].y_ticks] == ["0", "5", "10"]
    assert [tick.label for tick in queues.charts[1].y_ticks] == ["0 s", "1 min", "2 min"]
    assert queues.summary == [
        ("Latest reading", "at 11:51:"),
        ("mailpipe.bulk", "9 waiting, oldest 1.5 min"),
    ]


def test_the_day_labels_its_buckets_with_their_date() -> None:
    day = Activity(
        DAY,
        datetime(2025, 12, 31, 12, 45),
        {
            s: StageSeries({k: [0] * 95 + [3] for k in KINDS}, [None] * 96, [None] * 96)
            for s in Stage
        },
        [],
    )
    cpu = panels(day)[0]
    assert cpu.rows[0].time == "01 Jan 12:30"
    assert cpu.rows[0].cells[:4] == ["0.2"] * 4  # 3 in a quarter hour: 0.2 a minute
    assert [tick.label for tick in cpu.charts[0].x_ticks][:2] == ["15:00", "18:00"]


def test_scales_and_figures_read_as_an_operator_reads_them() -> None:
    assert [charts.COUNT.top(v) for v in (0, 0.3, 1, 7, 10, 11, 480, 730)] == [
        1,
        1,
        1,
        10,
        10,
        20,
        500,
        1000,
    ]
    assert [nice_seconds(v) for v in (0, 0.004, 0.31, 3, 59, 61, 400, 5000, 90000)] == [
        0.01,
        0.01,
        0.5,
        5,
        60,
        120,
        600,
        7200,
        172800,
    ]
    assert [seconds(v) for v in (None, 0, 0.0123, 2.5, 150, 7200)] == [
        "",
        "0 s",
        "12.3 ms",
        "2.5 s",
        "2.5 min",
        "2 h",
    ]
    assert [number(v) for v in (None, 0, 1234, 2.25, 0.2)] == ["", "0", "1,234", "2.2", "0.2"]
