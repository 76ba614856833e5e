"""A dependency's outage, and objects S3 refuses, under a backlog, each scenario on a fleet of its
own: runs failed, attempts used, the dependencies' health checks made, the time from recovery
until every run closed, and what the waiting fleet costs the broker during the outage.

    .venv/bin/python -m bench.outages [--emails 2000] [--outage 60] \\
        [--scenarios "baseline,s3 outage"] [--json out.json]

Each scenario gets services of its own: a `redis-server` on a free port (its `INFO` counters are
its fleet's alone), a PostgreSQL database on the machine's server (a PostgreSQL server of its own,
tests/support/services.py's PrivatePostgres, for the database outage), a fault proxy
(tests/support/flaky_proxy.py) between its workers and the one S3 server (moto) that serves every
scenario, and for the model outage a Bedrock stand-in (tests/support/bedrock_server.py). One
worker (`-P prefork -c 2`) is up before `mailpipe ingest` stores the emails straight to S3 and
enqueues them; the model outage adds the model role (`-P threads -c 8 -Q <queue>.model`, the
`bedrock` backend, the fleet's model rate limit at 100 calls/s so that it does not set the pace).

- **baseline**: no fault; its drain time is what the others are compared with (`over_baseline_s`).
- **denied objects**: S3 refuses 3 of the emails' objects (403 AccessDenied), the store's check
  passes: those runs fail, BlobAccessDenied, after their attempts; the stage never pauses.
- **s3 outage**: every S3 request answers 503 for `--outage` seconds from before the first job.
- **model outage**: the model answers ServiceUnavailableException for `--outage` seconds.
- **database outage**: the PostgreSQL server stops once a few runs succeeded, and starts again
  `--outage` seconds later (the runs are read only once it is back).
- **fleet refusal**: S3 answers 403 AccessDenied to every request for `--outage` seconds.

Every outage should fail no run and use no attempt: the dependency's check fails too, the jobs
defer, the stage pauses, and a probe ends the pause. The figures:

- `failed`, `failed_as`: runs failed, by error class; `attempts`: the runs' attempts summed (one
  per run when none was used up by a fault), `retried_runs`: runs with more than one;
- `checks`: the fleet's counters of health checks, per dependency (a healthy fleet runs none);
- `paused`: the first stage seen paused, and how long after the fault began;
- `redis_cmds_per_s`: the broker's `total_commands_processed` read twice, from when the paused
  stage's jobs are all back in the broker (none held by a worker) until a second before the
  outage ends (in the model outage the CPU stage may still be working through the backlog);
- `recovered_to_done_s`: from the outage's end until every run closed; `ingest_to_done_s`: from
  the start of `mailpipe ingest`; `over_baseline_s`: that, less the baseline's.

The workers get the default settings, except:

- `MAILPIPE_PAUSE_PROBE_INTERVAL=5` (`--probe-interval`; default 30 s): the probe's wait is part of
  the recovery time, and at 30 s it would be most of it.
- `MAILPIPE_HEALTH_CACHE_SECONDS=5` (`--health-cache`; the default, stated because the `checks`
  counted depend on it).
- `MAILPIPE_RETRY_BACKOFF_BASE=2`, `MAILPIPE_RETRY_BACKOFF_MAX=16` (defaults 200 s and 900 s): the
  three retries of a refused object wait at most 2 + 4 + 8 s instead of up to 1400 s. That
  retry horizon must be shorter than `--outage`, checked at start: retries alone would ride out
  a shorter outage, which would then prove nothing about the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from kombu.transport.redis import Channel
from redis import Redis

from bench import harness, workload
from bench.pauses import scalar, wait_until
from bench.report import table
from mailpipe.broker.queues import Stage, TaskName, control_queue, email_queue, model_queue
from mailpipe.cli.demo import fleet
from mailpipe.cli.demo.servers import PrivateRedis
from mailpipe.coordination import redis_keys
from mailpipe.errors import Dependency
from mailpipe.settings import Settings
from mailpipe.storage.keys import raw_email_key
from tests.support.bedrock_server import BedrockServer, bedrock_env, error, keyword_labels
from tests.support.flaky_proxy import FlakyProxy
from tests.support.services import PrivatePostgres, S3Server

BUCKET = "mailpipe-bench-outages"
SCENARIOS = (
    "baseline",
    "denied objects",
    "s3 outage",
    "model outage",
    "database outage",
    "fleet refusal",
)
RETRY_SETTINGS = {"MAILPIPE_RETRY_BACKOFF_BASE": "2", "MAILPIPE_RETRY_BACKOFF_MAX": "16"}
MODEL_SETTINGS = {"MAILPIPE_MODEL_RATE_PER_S": "100", "MAILPIPE_MODEL_BURST": "100"}
STAGE_TASKS = {Stage.CPU: TaskName.PROCESS_EMAIL, Stage.MODEL: TaskName.CLASSIFY_EMAIL}
UNAVAILABLE = error("ServiceUnavailableException", 503, "The service is unavailable.")
DENIED_OBJECTS = 3
# The database stops once this many runs succeeded: the fleet is at work, the backlog still there.
FEW_SUCCEEDED = 5
# The broker's window ends this long before the outage does, so that no recovery is in it.
WINDOW_MARGIN_S = 1.0
START_TIMEOUT_S = 120
DRAIN_TIMEOUT_S = 600

Db = psycopg.Connection[tuple[Any, ...]]


def settings_of(env: dict[str, str]) -> Settings:
    """The settings a process started with `env` reads (main keeps none of the shell's MAILPIPE_
    settings in this process's environment, so only `env`'s count)."""
    return Settings.model_validate(
        {
            k.removeprefix("MAILPIPE_").lower(): v
            for k, v in env.items()
            if k.startswith("MAILPIPE_")
        }
    )


def retry_horizon(settings: Settings) -> float:
    """The longest an email's retries wait in all: each backoff's ceiling (mailpipe.pipeline.policy's
    retry_delay), summed."""
    return sum(
        min(settings.retry_backoff_max, settings.retry_backoff_base * 2 ** (attempt - 1))
        for attempt in range(1, settings.max_retries + 1)
    )


class PauseWatch:
    """The first stage seen paused, and how long after `since`: polled in each of a scenario's
    waits, never inside the broker's measured window."""

    def __init__(self, broker: Redis, since: float) -> None:
        self.broker, self.since = broker, since
        self.stage: Stage | None = None
        self.seen: str | None = None

    def poll(self) -> Stage | None:
        if self.stage is None:
            for stage in Stage:
                if self.broker.exists(redis_keys.pause(stage)):
                    self.stage = stage
                    self.seen = f"{stage} after {time.monotonic() - self.since:.1f} s"
                    break
        return self.stage


def held_jobs(broker: Redis, stage: Stage) -> int:
    """The stage's jobs delivered to a worker and not yet acknowledged: kombu's unacked hash
    holds each message as [message, exchange, routing key], its task naming its stage."""
    task = STAGE_TASKS[stage]
    return sum(
        json.loads(raw)[0]["headers"]["task"] == task for raw in broker.hvals(Channel.unacked_key)
    )


def broker_window(broker: Redis, watch: PauseWatch, ends: float) -> float | None:
    """Redis commands per second of the waiting fleet: from when a stage is paused with none of
    its jobs held by a worker (the steady state bench/pauses.py settles for; the jobs that were
    running or deferred are back in the queue) until a margin before the outage `ends`. None when
    no stage settled so before then."""
    while (stage := watch.poll()) is None or held_jobs(broker, stage):
        if time.monotonic() > ends - 2 * WINDOW_MARGIN_S:
            return None
        time.sleep(0.2)
    before, at = int(broker.info("stats")["total_commands_processed"]), time.monotonic()
    time.sleep(max(0.0, ends - WINDOW_MARGIN_S - at))
    after = int(broker.info("stats")["total_commands_processed"])
    return round((after - before) / (time.monotonic() - at), 1)


def start_workers(name: str, env: dict[str, str], logs: Path, stack: contextlib.ExitStack) -> None:
    settings = settings_of(env)
    if name == "model outage":
        workers = [
            fleet.worker(
                env,
                logs,
                name="worker",
                extra_args=("-Q", f"{email_queue(settings)},{control_queue(settings)}"),
            ),
            fleet.worker(
                env,
                logs,
                concurrency=8,
                name="model",
                pool="threads",
                extra_args=("-Q", model_queue(settings)),
            ),
        ]
    else:
        workers = [fleet.worker(env, logs, concurrency=2, name="worker")]
    for worker in workers:
        worker.start()
        stack.callback(worker.stop)
    for worker in workers:
        worker.wait_ready(START_TIMEOUT_S)


@dataclass
class Services:
    """A scenario's own services, and the environment of its processes."""

    env: dict[str, str]
    broker: Redis
    proxy: FlakyProxy
    model: BedrockServer | None
    pg: PrivatePostgres | None

    @property
    def database_url(self) -> str:
        return self.env["MAILPIPE_DATABASE_URL"]


def services(
    name: str, args: argparse.Namespace, s3: S3Server, logs: Path, stack: contextlib.ExitStack
) -> Services:
    redis_server = PrivateRedis(logs / "redis.log").start()
    stack.callback(redis_server.stop)
    broker = Redis.from_url(redis_server.url)
    stack.callback(broker.close)
    proxy = FlakyProxy(s3.url).start()
    stack.callback(proxy.stop)
    extra = {
        "MAILPIPE_BROKER_URL": redis_server.url,
        "MAILPIPE_S3_ENDPOINT_URL": s3.url,
        "MAILPIPE_PAUSE_PROBE_INTERVAL": str(args.probe_interval),
        "MAILPIPE_HEALTH_CACHE_SECONDS": str(args.health_cache),
        **RETRY_SETTINGS,
    }
    model = None
    if name == "model outage":
        model = BedrockServer(default=UNAVAILABLE).start()
        stack.callback(model.stop)
        extra |= bedrock_env(model, logs) | MODEL_SETTINGS
    pg = None
    if name == "database outage":
        pg = PrivatePostgres()
        stack.callback(pg.destroy)
        pg.start()
        database_url = pg.url
    else:
        database = harness.database(f"mailpipe_bench_outages_{uuid.uuid4().hex[:8]}")
        stack.callback(database.drop)
        database_url = database.create().url
    env = harness.base_env(
        database_url=database_url, prefix="", blob_url=f"s3://{BUCKET}/blobs", **extra
    )
    return Services({**harness.env_without_settings(), **env}, broker, proxy, model, pg)


def succeeded_runs(db: Db) -> int:
    return scalar(db, "SELECT count(*) FROM pipeline_run WHERE status = 'succeeded'")


def run_scenario(
    name: str,
    args: argparse.Namespace,
    folder: Path,
    emails: list[bytes],
    s3: S3Server,
    workdir: Path,
) -> dict[str, Any]:
    logs = workdir / name.replace(" ", "-")
    outage = name not in ("baseline", "denied objects")
    with contextlib.ExitStack() as stack:
        svc = services(name, args, s3, logs, stack)
        harness.run_mailpipe(harness.REPO, svc.env, "db", "upgrade")
        harness.run_mailpipe(harness.REPO, svc.env, "model-calls", "on")
        # The workers reach S3 through the proxy; ingest stores the emails directly.
        start_workers(name, {**svc.env, "MAILPIPE_S3_ENDPOINT_URL": svc.proxy.url}, logs, stack)

        if name == "denied objects":
            spread = [emails[k * len(emails) // DENIED_OBJECTS] for k in range(DENIED_OBJECTS)]
            svc.proxy.deny_keys({raw_email_key(hashlib.sha256(raw).hexdigest()) for raw in spread})
        fault_at = time.monotonic()
        if name == "s3 outage":
            svc.proxy.fail_for(args.outage)
        elif name == "fleet refusal":
            svc.proxy.deny(True, "AccessDenied")
        ingested_at = time.monotonic()
        harness.ingest(harness.REPO, svc.env, folder, len(emails))
        if svc.pg is not None:
            with psycopg.connect(svc.database_url, autocommit=True) as db:
                wait_until(
                    lambda: succeeded_runs(db) >= FEW_SUCCEEDED,
                    DRAIN_TIMEOUT_S,
                    f"{name}: {FEW_SUCCEEDED} runs succeeded",
                    every=0.05,
                )
            fault_at = time.monotonic()
            svc.pg.stop()
        watch = PauseWatch(svc.broker, fault_at if outage else ingested_at)

        cmds_per_s = None
        recovered = None
        if outage:
            ends = fault_at + args.outage
            cmds_per_s = broker_window(svc.broker, watch, ends)
            time.sleep(max(0.0, ends - time.monotonic()))
            # The s3 outage's 503s (the proxy's fail_for) end by themselves, at `ends`.
            if svc.model is not None:
                svc.model.default = keyword_labels
            elif name == "fleet refusal":
                svc.proxy.deny(False)
            elif svc.pg is not None:
                svc.pg.start()
            recovered = time.monotonic()

        with psycopg.connect(svc.database_url, autocommit=True) as db:

            def drained() -> bool:
                watch.poll()
                return scalar(
                    db, "SELECT count(*) FROM pipeline_run WHERE status <> 'open'"
                ) == len(emails)

            wait_until(drained, DRAIN_TIMEOUT_S, f"{name}: every run closed", every=0.2)
            done = time.monotonic()
            failed_as = db.execute(
                "SELECT error_class, count(*) FROM pipeline_run WHERE status = 'failed' "
                "GROUP BY error_class ORDER BY error_class"
            ).fetchall()
            attempts = scalar(db, "SELECT coalesce(sum(attempts), 0) FROM pipeline_run")
            retried = scalar(db, "SELECT count(*) FROM pipeline_run WHERE attempts > 1")
        checks = {
            str(dependency): int(svc.broker.get(redis_keys.health_checks_counter(dependency)) or 0)
            for dependency in Dependency
        }
    return {
        "scenario": name,
        "emails": len(emails),
        "outage_s": args.outage if outage else None,
        "failed": sum(count for _, count in failed_as),
        "failed_as": {error_class: count for error_class, count in failed_as},
        "attempts": attempts,
        "retried_runs": retried,
        "checks": checks,
        "paused": watch.seen,
        "redis_cmds_per_s": cmds_per_s,
        "recovered_to_done_s": None if recovered is None else round(done - recovered, 1),
        "ingest_to_done_s": round(done - ingested_at, 1),
    }


def shown(value: object) -> object:
    """A figure as the table prints it: a dict as `key n` pairs (its non-zero ones), nothing as -."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {n}" for k, n in value.items() if n) or "-"
    return "-" if value is None else value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=2000)
    parser.add_argument("--outage", type=float, default=60.0, help="seconds each outage lasts")
    parser.add_argument(
        "--scenarios",
        type=lambda text: [name.strip() for name in text.split(",")],
        default=list(SCENARIOS),
        help=f"comma-separated, of: {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--probe-interval", type=float, default=5.0)
    parser.add_argument("--health-cache", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)}")
    # This process reads the fleets' Redis keys (redis_keys) with their settings: the defaults,
    # whatever the shell has set, as each fleet's processes get.
    for setting in set(os.environ) - set(harness.env_without_settings()):
        del os.environ[setting]
    horizon = retry_horizon(settings_of(RETRY_SETTINGS))
    if args.outage <= horizon:
        parser.error(f"--outage must outlast the retry horizon ({horizon:g} s)")

    workdir = Path(tempfile.mkdtemp(prefix="mailpipe-outages-"))
    try:
        emails, _ = workload.plain_workload(args.emails)
        folder = harness.write_emails(workdir / "emails", emails)
        s3 = S3Server(workdir / "moto.log").start(BUCKET)
        try:
            results = [
                run_scenario(name, args, folder, emails, s3, workdir)
                for name in SCENARIOS
                if name in args.scenarios
            ]
        finally:
            s3.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    baseline = next((r["ingest_to_done_s"] for r in results if r["scenario"] == "baseline"), None)
    for result in results:
        result["over_baseline_s"] = (
            None if baseline is None else round(result["ingest_to_done_s"] - baseline, 1)
        )
    print(table([{k: shown(v) for k, v in r.items()} for r in results], list(results[0])))
    if args.json:
        harness.write_report(args.json, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
