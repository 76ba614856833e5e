"""The overview's charts of the fleet over time (mailpipe.operations.activity), as geometry that
`templates/_charts.html` draws as SVG: no script, no style attribute (the CSP allows neither),
classes that `static/console.css` colours. Every value drawn has a title (a hover, and what a
screen reader reads), and each panel its figures as a table under its charts."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from mailpipe.broker.queues import Stage
from mailpipe.operations.activity import KINDS, Activity, LaneSeries, Window

# The viewBox; the page scales it to the panel's width.
WIDTH, HEIGHT = 600, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 22
# Bars stacked from the bottom in this order: the work done first, the failures on top.
STACKED = ("succeeded", "retried", "deferred", "failed")
QUANTILES = ("p50", "p90")
STAGE_TITLES = {Stage.CPU: "CPU stage", Stage.MODEL: "Model stage"}
# A tick on the time axis at each multiple of this, by window.
TIME_TICKS = {"hour": timedelta(minutes=10), "day": timedelta(hours=3)}
# A time scale's tops past 10 s, in seconds.
CLOCK = (15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


@dataclass(frozen=True)
class Tick:
    at: float
    label: str


@dataclass(frozen=True)
class Rect:
    kind: str  # a class: what the part of the bar counts
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Column:
    """One bucket's bar: its parts stacked, and its figures as a title."""

    title: str
    rects: list[Rect]


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    title: str


@dataclass(frozen=True)
class Line:
    kind: str  # a class
    label: str
    segments: list[str]  # each run of buckets with a value, as an SVG `points` attribute
    points: list[Point]


@dataclass(frozen=True)
class Chart:
    title: str
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    columns: list[Column]
    lines: list[Line]
    legend: list[tuple[str, str]]  # (class, label)
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right: int = WIDTH - RIGHT
    top: int = TOP
    bottom: int = HEIGHT - BOTTOM


@dataclass(frozen=True)
class Row:
    """One bucket's figures, as the table beside a chart shows them."""

    time: str
    cells: list[str]


@dataclass(frozen=True)
class Panel:
    key: str  # the stage, or "queues"
    title: str
    charts: list[Chart]
    summary: list[tuple[str, str]]  # (in bold, the rest): the window's totals, the latest reading
    headings: list[str]
    rows: list[Row]  # the buckets with something to show, the latest first


@dataclass(frozen=True)
class Unit:
    """How a chart's values are shown and its scale's top chosen."""

    shown: Callable[[float | None], str]
    top: Callable[[float], float]  # a scale's top for its largest value


def panels(activity: Activity) -> list[Panel]:
    """A panel per stage (its attempts a minute and their durations), then the queues'."""
    return [*(_stage_panel(activity, stage) for stage in activity.stages), _queue_panel(activity)]


def _stage_panel(activity: Activity, stage: Stage) -> Panel:
    series = activity.stages[stage]
    times = activity.times
    label = _time_label(activity.window)
    rates = {kind: [activity.per_minute(n) for n in series.jobs[kind]] for kind in KINDS}
    quantiles = {"p50": series.p50_s, "p90": series.p90_s}
    jobs = stacked_bars(
        "attempts a minute, by what they came to",
        times,
        {kind: rates[kind] for kind in STACKED},
        activity.window,
        lambda i: (
            f"{label(times[i])}: "
            + ", ".join(f"{number(rates[kind][i])} {kind}" for kind in KINDS)
            + " a minute"
        ),
    )
    durations = line_chart(
        "how long the attempts that succeeded ran",
        times,
        {(kind, kind): quantiles[kind] for kind in QUANTILES},
        activity.window,
        TIME,
    )
    rows = [
        Row(
            label(times[i]),
            [number(rates[kind][i]) for kind in KINDS]
            + [seconds(quantiles[q][i]) for q in QUANTILES],
        )
        for i in reversed(range(len(times)))
        if any(series.jobs[kind][i] for kind in KINDS)
    ]
    return Panel(
        key=stage.value,
        title=STAGE_TITLES[stage],
        charts=[jobs, durations],
        summary=[(f"{sum(series.jobs[kind]):,}", kind) for kind in KINDS],
        headings=[*(f"{kind} /min" for kind in KINDS), *QUANTILES],
        rows=rows,
    )


def _queue_panel(activity: Activity) -> Panel:
    times = activity.times
    label = _time_label(activity.window)
    lanes = {f"lane-{i % 4}": lane for i, lane in enumerate(activity.lanes)}
    depth = line_chart(
        "jobs waiting, the most a report read in the bucket",
        times,
        {(kind, lane.name): lane.depth for kind, lane in lanes.items()},
        activity.window,
        COUNT,
    )
    oldest = line_chart(
        "the oldest job's wait, the longest a report read in the bucket",
        times,
        {(kind, lane.name): lane.oldest_age_s for kind, lane in lanes.items()},
        activity.window,
        TIME,
    )

    def reading(lane: LaneSeries, i: int) -> str:
        return f"{number(lane.depth[i])} waiting, oldest {seconds(lane.oldest_age_s[i])}"

    rows = [
        Row(
            label(times[i]),
            [reading(lane, i) if lane.depth[i] is not None else "" for lane in lanes.values()],
        )
        for i in reversed(range(len(times)))
        if any(lane.depth[i] is not None for lane in lanes.values())
    ]
    # The latest bucket a report read, and each lane's reading in it.
    summary = []
    if rows:
        summary = [("Latest reading", f"at {rows[0].time}:")]
        summary += [
            (lane.name, cell)
            for lane, cell in zip(lanes.values(), rows[0].cells, strict=True)
            if cell
        ]
    return Panel(
        key="queues",
        title="Queues",
        charts=[depth, oldest],
        summary=summary,
        headings=[lane.name for lane in lanes.values()],
        rows=rows,
    )


def stacked_bars(
    title: str,
    times: Sequence[datetime],
    series: Mapping[str, Sequence[float]],
    window: Window,
    titled: Callable[[int], str],
) -> Chart:
    """A bar per bucket, its parts stacked from the bottom in the order of `series`, titled by
    `titled(bucket)`; a bucket with nothing has no bar."""
    n = len(times)
    totals = [sum(values[i] for values in series.values()) for i in range(n)]
    top = COUNT.top(max(totals, default=0))
    scale = _scale(top)
    slot = (WIDTH - RIGHT - LEFT) / n
    columns = []
    for i in range(n):
        if not totals[i]:
            continue
        rects, below = [], 0.0
        for kind, values in series.items():
            if values[i]:
                y = scale(below + values[i])
                x = _r(LEFT + i * slot + slot * 0.1)
                rects.append(Rect(kind, x, y, _r(slot * 0.8), _r(scale(below) - y)))
                below += values[i]
        columns.append(Column(titled(i), rects))
    return Chart(
        title=title,
        y_ticks=_y_ticks(top, scale, COUNT),
        x_ticks=_x_ticks(times, window),
        columns=columns,
        lines=[],
        legend=[(kind, kind) for kind in series],
    )


def line_chart(
    title: str,
    times: Sequence[datetime],
    series: Mapping[tuple[str, str], Sequence[float | None]],
    window: Window,
    unit: Unit,
) -> Chart:
    """A line per (class, name) through the middle of each bucket, broken where a bucket has
    no value (None); a dot on each value, titled with it."""
    top = unit.top(max((v for line in series.values() for v in line if v is not None), default=0))
    scale = _scale(top)
    slot = (WIDTH - RIGHT - LEFT) / len(times)
    label = _time_label(window)
    lines = []
    for (kind, name), line in series.items():
        segments: list[list[str]] = []
        points = []
        for i, value in enumerate(line):
            if value is None:
                continue
            x, y = _r(LEFT + (i + 0.5) * slot), scale(value)
            if i == 0 or line[i - 1] is None:
                segments.append([])
            segments[-1].append(f"{x},{y}")
            points.append(Point(x, y, f"{label(times[i])}: {name} {unit.shown(value)}"))
        lines.append(Line(kind, name, [" ".join(s) for s in segments], points))
    return Chart(
        title=title,
        y_ticks=_y_ticks(top, scale, unit),
        x_ticks=_x_ticks(times, window),
        columns=[],
        lines=lines,
        legend=[(kind, name) for kind, name in series],
    )


def nice(value: float, steps: Sequence[float]) -> float:
    """The least of `steps` times a power of ten that is at least `value`: a scale's top."""
    power = 10 ** math.floor(math.log10(value))
    return min(step * power for step in (*steps, 10) if step * power >= value * (1 - 1e-9))


def nice_seconds(value: float) -> float:
    """A time scale's top: 1, 2 or 5 times a power of ten up to 10 s (at least 10 ms), then the
    steps a clock is read in, then whole days."""
    if value <= 10:
        return nice(max(value, 0.01), (1, 2, 5))
    for top in CLOCK:
        if top >= value:
            return top
    return 86400 * nice(value / 86400, (1, 2, 5))


def number(value: float | None) -> str:
    if value is None:
        return ""
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def seconds(value: float | None) -> str:
    """A duration or an age: ms under a second, s under a minute, then min and h."""
    if value is None:
        return ""
    if value == 0:
        return "0 s"
    if value < 1:
        return f"{value * 1000:.3g} ms"
    if value < 60:
        return f"{value:.3g} s"
    if value < 3600:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


COUNT = Unit(number, lambda value: nice(max(value, 1), (1, 2, 5)))
TIME = Unit(seconds, nice_seconds)


def _scale(top: float) -> Callable[[float], float]:
    plot = HEIGHT - BOTTOM - TOP
    return lambda value: _r(HEIGHT - BOTTOM - value / top * plot)


def _y_ticks(top: float, scale: Callable[[float], float], unit: Unit) -> list[Tick]:
    return [Tick(scale(v), unit.shown(v)) for v in (0, top / 2, top)]


def _x_ticks(times: Sequence[datetime], window: Window) -> list[Tick]:
    every = TIME_TICKS[window.name]
    slot = (WIDTH - RIGHT - LEFT) / len(times)
    return [
        Tick(_r(LEFT + i * slot), at.strftime("%H:%M"))
        for i, at in enumerate(times)
        if (at - datetime.min) % every == timedelta(0)
    ]


def _time_label(window: Window) -> Callable[[datetime], str]:
    """A bucket's start as its row and titles name it: the time, and over a day the date too."""
    shown = "%H:%M" if window.span <= timedelta(hours=1) else "%d %b %H:%M"
    return lambda at: at.strftime(shown)


def _r(value: float) -> float:
    return round(value, 1)
