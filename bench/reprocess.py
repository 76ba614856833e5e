"""Reprocess: a hundred thousand succeeded emails run again from their model stage, and the live
lane's latency meanwhile against without it, in the same run.

    .venv/bin/python -m bench.reprocess [--emails 100000] [--live-rate 2] [--live-seconds 60] \\
        [--delay 0.2] [--rate 100] [--drain 300] [--timeout 3600] [--json results.json]

One setup (bench/model_stage.py's `Setup`: a PostgreSQL database, a Redis key prefix, a blob
folder, the local Converse server answering after `--delay` seconds, a fleet limit of `--rate`
calls/s) and the `worker` and `model` roles started from their Procfile lines, model calls on.

1. `--emails` succeeded emails are seeded in SQL (`seed`) as the pipeline leaves them: a run
   converted and classified, the model's input as the CPU stage keeps it, the answer and its
   label `newsletter`. The live emails are invoices, labelled `invoice`: the reprocess's filter
   never takes one.
2. Window 1, the baseline: for `--live-seconds`, `--live-rate` live emails a second, each timed
   from the start of its store to its run's close (bench/lanes.py `send_live`, `live_latency`).
3. `mailpipe reprocess --label newsletter --from classify --yes --over-max` starts (a
   subprocess, in the bulk lane by default; past MAILPIPE_REPROCESS_MAX), timed on its own: it
   reopens the runs in batches and sends their model stage. Window 2 starts with it: the same
   live emails at the same rate.
4. The reprocess is followed to its end as the overview reads it (`status.reprocesses`): its
   time from the command's start to its last run's close, and its runs closed per second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import harness
from bench.lanes import Live, in_process, live_latency, naive, send_live
from bench.model_stage import Fleet, Setup, mailpipe

if TYPE_CHECKING:
    from mailpipe.resources import Resources

LABEL = "newsletter"

# What a finished run of a newsletter leaves: the email's row, its run succeeded, the model's
# input as the CPU stage stores it (`input_as_json`: a body of about 600 characters, no
# documents), the model's answer and the label synced from it.
SEED = (
    "INSERT INTO email_message (blob_key, size, sha256, received_at, created_at, subject, "
    "sender, has_run) "
    "SELECT 'raw/seed/' || g || '.eml', 2400, encode(sha256(g::text::bytea), 'hex'), "
    "now() - (%(emails)s - g) * interval '1 second', now() - (%(emails)s - g) * interval "
    "'1 second', 'Weekly digest ' || g, 'news@list' || g %% 50 || '.example', true "
    "FROM generate_series(1, %(emails)s) g",
    "INSERT INTO pipeline_run (email_id, status, attempts, claims, cutoffs, sweep_count, "
    "created_at, updated_at, converted_at, classified_at, closed_at) "
    "SELECT id, 'succeeded', 1, 2, 0, 0, received_at, received_at, received_at, received_at, "
    "received_at FROM email_message",
    "INSERT INTO model_input (email_id, input, created_at) "
    "SELECT id, json_build_object('subject', subject, 'sender', sender, "
    "'recipients', json_build_array('team@example.org'), "
    "'date', to_char(received_at, 'Dy, DD Mon YYYY HH24:MI:SS +0000'), "
    "'body_text', 'This week''s digest, number ' || id || E'.\\r\\n\\r\\n' "
    "|| repeat(E'A story of the week, in a line or two of text.\\r\\n', 11) "
    "|| E'To unsubscribe, follow the link at the foot of this email.\\r\\n', "
    "'documents', json_build_array(), 'more_recipients', 0), received_at FROM email_message",
    "INSERT INTO classification (run_id, email_id, model_id, prompt_version, output, labels, "
    "input_tokens, output_tokens, latency_ms, created_at) "
    "SELECT id, email_id, %(model_id)s, %(prompt_version)s, "
    "json_build_object('labels', json_build_array(json_build_object('label', %(label)s::text, "
    "'confidence', 0.9))), json_build_array(json_build_array(%(label)s::text, 0.9)), "
    "480, 42, 900, closed_at FROM pipeline_run",
    "INSERT INTO email_label (email_id, label, source, confidence, created_at) "
    "SELECT email_id, %(label)s, 'model', 0.9, created_at FROM classification",
)

_DONE = re.compile(r"^reprocess (\d+): reopened (\d+), enqueued (\d+)$", re.MULTILINE)


def seed(url: str, emails: int) -> None:
    import psycopg

    from mailpipe.classifiers.prompt import PROMPT_VERSION
    from mailpipe.settings import Settings

    given = {
        "emails": emails,
        "label": LABEL,
        "model_id": Settings.model_fields["bedrock_model_id"].default,
        "prompt_version": PROMPT_VERSION,
    }
    with psycopg.connect(url) as conn:
        for statement in SEED:
            conn.execute(statement, given)
    # What autovacuum does to a table loaded so: statistics for the reprocess's queries.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


class Command(threading.Thread):
    """`mailpipe reprocess` in a subprocess, timed, while this process sends live emails."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.env = env
        self.started = self.ended = 0.0
        self.output = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started = time.time()
        try:
            self.output = mailpipe(
                self.env,
                *("reprocess", "--label", LABEL, "--from", "classify", "--yes", "--over-max"),
            )
        except BaseException as exc:
            self.error = exc
        self.ended = time.time()


def follow(res: Resources, emails: int, timeout: float) -> tuple[dict[str, Any], list[list[float]]]:
    """The reprocess's progress as the overview reads it, every 5 s until no run is left;
    returns its last reading and the readings (seconds, runs done)."""
    from mailpipe.operations.status import reprocesses

    readings: list[list[float]] = []
    started = time.monotonic()
    while True:
        with res.db.session() as session:
            [latest] = reprocesses(session, latest=1)
        readings.append([round(time.monotonic() - started, 1), latest["done"]])
        if latest["left"] == 0 and latest["done"] + latest["failed"] == emails:
            return latest, readings
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"the reprocess did not end within {timeout} s: {latest}")
        time.sleep(5)


def closes(res: Resources, reprocess_id: int, start: float, end: float) -> int:
    """The reprocess's runs that closed from `start` to `end`."""
    from sqlalchemy import func, select

    from mailpipe.storage.models import PipelineRun

    with res.db.session() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(PipelineRun)
                .where(
                    PipelineRun.reprocess_id == reprocess_id,
                    PipelineRun.closed_at >= naive(start),
                    PipelineRun.closed_at < naive(end),
                )
            )
            or 0
        )


def last_close(res: Resources, reprocess_id: int) -> float:
    from sqlalchemy import func, select

    from mailpipe.storage.models import PipelineRun

    with res.db.session() as session:
        at = session.scalar(
            select(func.max(PipelineRun.closed_at)).where(PipelineRun.reprocess_id == reprocess_id)
        )
    assert at is not None
    return at.replace(tzinfo=UTC).timestamp()


def stages(res: Resources, live: Live) -> dict[str, float]:
    """Where the live emails' time went: from the start of the store to the CPU stage's end (its
    queue and the stage), and from there to the run's close (the model stage's queue, the
    limiter's wait and the call)."""
    from sqlalchemy import select

    from mailpipe.storage.models import PipelineRun

    with res.db.session() as session:
        rows = session.execute(
            select(PipelineRun.email_id, PipelineRun.converted_at, PipelineRun.closed_at).where(
                PipelineRun.email_id.in_(live.started)
            )
        ).all()
    cpu, model = [], []
    for email_id, converted_at, closed_at in rows:
        if converted_at is None or closed_at is None:
            continue
        converted = converted_at.replace(tzinfo=UTC).timestamp()
        cpu.append(converted - live.started[email_id])
        model.append(closed_at.replace(tzinfo=UTC).timestamp() - converted)
    return {
        "to_cpu_stage_end_p99": round(harness.percentile(cpu, 0.99), 2),
        "model_stage_p50": round(harness.percentile(model, 0.5), 2),
        "model_stage_p99": round(harness.percentile(model, 0.99), 2),
    }


def window(res: Resources, live: Live, drain: float) -> dict[str, Any]:
    return {
        **live_latency(res, live, drain),
        "stages_s": stages(res, live),
        "load_avg": [round(load, 2) for load in os.getloadavg()],
    }


def measure(
    emails: int,
    live_rate: float,
    live_seconds: float,
    delay: float,
    rate: float,
    drain: float,
    timeout: float,
) -> dict[str, Any]:
    setup = Setup("reprocess", delay, rate)
    fleet = None
    try:
        seeding = time.monotonic()
        seed(setup.database.url, emails)
        seeded_s = time.monotonic() - seeding
        mailpipe(setup.env, "model-calls", "on")
        res = in_process(setup)
        fleet = Fleet(setup.env, setup.work).start()

        baseline = window(res, send_live(res, live_rate, live_seconds), drain)

        command = Command(setup.env)
        command.start()
        during = send_live(res, live_rate, live_seconds)
        command.join()
        if command.error is not None:
            raise command.error
        done = _DONE.search(command.output)
        if done is None:
            raise RuntimeError(f"mailpipe reprocess: {command.output.strip()}")
        reprocess_id, reopened, enqueued = (int(n) for n in done.groups())
        with_reprocess = window(res, during, drain)

        progress, readings = follow(res, reopened, timeout)
        ended = last_close(res, reprocess_id)
        total = ended - command.started
        in_window = closes(res, reprocess_id, during.window_start, during.window_end)
        after = closes(res, reprocess_id, during.window_end, ended + 1)
        return {
            "emails": emails,
            "seeded_s": round(seeded_s, 1),
            "reprocess": {
                "reopened": reopened,
                "enqueued": enqueued,
                "failed": progress["failed"],
                "command_s": round(command.ended - command.started, 1),
                "total_s": round(total, 1),
                "runs_per_s": round(reopened / total, 2),
                "runs_per_s_in_window_2": round(in_window / during.seconds, 2),
                "runs_per_s_after_window_2": round(after / (ended - during.window_end), 2),
                "progress": readings,
            },
            "without": baseline,
            "with": with_reprocess,
            "model_calls": len(setup.server.arrivals()),
            "load_avg_at_end": [round(load, 2) for load in os.getloadavg()],
        }
    finally:
        if fleet is not None:
            fleet.stop()
        setup.close()


def table(result: dict[str, Any]) -> str:
    rep = result["reprocess"]
    lines = [
        f"reprocess of {rep['reopened']:,} from classify: command {rep['command_s']} s, "
        f"all closed after {rep['total_s']} s, {rep['runs_per_s']} runs/s "
        f"({rep['runs_per_s_in_window_2']}/s in window 2, {rep['runs_per_s_after_window_2']}/s "
        f"after), {rep['failed']} failed",
        "",
        "| live lane | p50 | p99 | max | not closed | load (1 min) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("without", "with"):
        way = result[name]
        latency = way["live_latency_s"]
        lines.append(
            f"| {name} the reprocess | {latency['p50']} s | {latency['p99']} s | "
            f"{latency['max']} s | {way['live_not_closed_within_drain']} | {way['load_avg'][0]} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=100_000)
    parser.add_argument("--live-rate", type=float, default=2.0)
    parser.add_argument("--live-seconds", type=float, default=60.0)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--drain", type=float, default=300.0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    machine = harness.machine()
    started = time.monotonic()
    result = measure(
        args.emails,
        args.live_rate,
        args.live_seconds,
        args.delay,
        args.rate,
        args.drain,
        args.timeout,
    )
    report = {
        "machine": machine,
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "result": result,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=2))
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
