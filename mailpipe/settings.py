"""One typed settings object, read from the environment (prefix ``MAILPIPE_``).

Every default is the embedded setup: a SQLite file, a local blob folder, the local Redis, model
calls off and the `rules` classifier. Production overrides them through the environment only; no
secret has a default here.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_LABELS = (
    "invoice",
    "newsletter",
    "security",
    "bounce",
    "spam",
    "personal",
    "support",
    "calendar",
)
# The sslmodes under which libpq refuses a server that does not speak TLS.
TLS_SSLMODES = ("require", "verify-ca", "verify-full")
# The broker URL's schemes that both kombu (the broker) and redis-py's `Redis.from_url`
# (mailpipe's own clients: leases, markers, locks, heartbeats) understand. kombu's sentinel://
# is not one (from_url speaks to one server); nor is a Unix socket, unix:// to redis-py but
# redis+socket:// to kombu.
BROKER_SCHEMES = ("redis", "rediss")
# MAILPIPE_WEB_SECRET's least length: as many bytes as the SHA-256 of its HMAC, and as many as
# the console draws when it is unset.
WEB_SECRET_BYTES = 32
# The longest any window, wait or interval may be set to (seconds): ten years, as the longest
# retention (`keep_attempts_days`). Longer is never meant, and past it the arithmetic of times
# overflows (a cut-off before year 1 raises on every pass); so does infinity, refused for every
# float with NaN (`allow_inf_nan`).
LONGEST_DAYS = 3650
LONGEST_S = LONGEST_DAYS * 24 * 3600
# A window, wait or interval in seconds, within that bound; each field adds its own least value.
Seconds = Annotated[float, Field(le=LONGEST_S)]
WholeSeconds = Annotated[int, Field(le=LONGEST_S)]


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address; a host name or "" (all interfaces) is not known to be."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    # Errors never quote what was given: a value may be a password, a token or a mailbox's name.
    model_config = SettingsConfigDict(
        env_prefix="MAILPIPE_",
        frozen=True,
        extra="ignore",
        allow_inf_nan=False,
        hide_input_in_errors=True,
    )

    # Where things live.
    database_url: str = "sqlite:///var/mailpipe.db"
    broker_url: str = "redis://localhost:6379/0"
    blob_url: str = "file://var/blobs"
    s3_endpoint_url: str | None = None
    queue: str = "mailpipe"
    # Put before every Redis key of mailpipe and kombu, so that several environments (or the
    # demo and a fleet) can share one Redis without seeing each other's jobs and markers.
    redis_prefix: str = ""

    # Classification.
    model_backend: Literal["rules", "bedrock"] = "rules"
    rules_file: Path | None = None
    labels: tuple[str, ...] = DEFAULT_LABELS
    bedrock_model_id: str = "anthropic.claude-3-5-haiku-20241022-v1:0"
    bedrock_region: str = "us-east-1"
    bedrock_max_tokens: int = Field(256, ge=16, le=4096)
    classifier_text_budget: int = Field(24_000, ge=1_000)  # characters of email + documents
    model_rate_per_s: float = Field(5.0, gt=0)  # fleet-wide model calls per second
    model_burst: int = Field(5, ge=1)
    model_max_in_flight: int = Field(16, ge=1)  # fleet-wide model calls at once
    # A mailbox's ceiling on model calls per second, fleet-wide, under the fleet's own limit:
    # `mailbox_model_rate` for every mailbox (0: none), `mailbox_model_rates` for the mailboxes
    # named, a JSON object of shown name (the default mailbox is "default") to calls/s, 0 lifting
    # the ceiling for that one (docs/mailboxes.md, "A mailbox's ceiling on model calls").
    mailbox_model_rate: float = Field(0.0, ge=0)
    # Read as a JSON object, kept as its (name, rate) pairs: the settings are hashed.
    mailbox_model_rates: tuple[tuple[str, float], ...] = ()
    # How long a model-stage job waits in its thread for a model-call slot before it is deferred.
    model_slot_wait: Seconds = Field(30.0, ge=0)
    # How long a job process trusts the model-calls flag it read (seconds): `mailpipe model-calls
    # on|off` reaches every worker within this; 0 reads it on every job.
    model_calls_cache_seconds: Seconds = Field(5.0, ge=0)

    # The bulk lane's model stage through Bedrock batch inference (docs/batch.md): `on`, `off`,
    # or unset for on with the `bedrock` backend and a batch role. Batches of at most `size` records
    # are formed once that many wait, or `wait` seconds after the oldest began to wait, within
    # the model's record limits per job (`min`, `max`); a leftover under `min` goes through
    # real-time Converse once it has waited `max_wait`.
    model_batch: Literal["on", "off"] | None = None
    model_batch_size: int = Field(10_000, ge=1)
    model_batch_min: int = Field(100, ge=1)
    model_batch_max: int = Field(50_000, ge=1)
    model_batch_wait: WholeSeconds = Field(3600, ge=0)
    model_batch_max_wait: WholeSeconds = Field(6 * 3600, ge=0)
    # The service role Bedrock assumes to read the input and write the output.
    model_batch_role_arn: str | None = None
    # Bedrock ends a job it has not finished in this many hours (Expired); 24 to 168.
    model_batch_timeout_hours: int = Field(24, ge=24, le=168)
    # How often beat's leader forms, submits and follows batches (seconds).
    model_batch_interval: Seconds = Field(60.0, gt=0)

    # Jobs: time limits, retries and the broker's redelivery window (seconds).
    visibility_timeout: WholeSeconds = Field(1800, ge=5)
    task_soft_time_limit: WholeSeconds = Field(240, ge=1)
    task_time_limit: WholeSeconds = Field(300, ge=2)
    max_retries: int = Field(3, ge=0)
    # A failed attempt waits between half and all of min(max, base * 2**(attempt - 1)): with the
    # defaults the 3 retries wait 100-200, 200-400 and 400-800 s, at least 700 s together, so
    # that an email whose own attempts fail keeps them over minutes, not seconds.
    retry_backoff_base: Seconds = Field(200.0, gt=0)
    retry_backoff_max: WholeSeconds = Field(900, ge=1)
    # Renewed before half of it has passed while the job runs.
    lease_ttl: WholeSeconds = Field(30, ge=3)
    # The enqueue dedup marker lapses this long after it was last set; sweeps refresh the markers
    # of jobs they find in the broker, so a waiting job keeps its marker however long it waits.
    dedup_ttl: WholeSeconds = Field(3600, ge=2)
    # Deferrals (a held lease, the fleet rate limit, the provider's throttling) wait without
    # using an attempt, this long in all before the run is failed with the reason. A job waiting
    # out a dependency's outage is deferred too, from `defer_base` seconds growing with the time
    # waited up to `defer_max` at a time, and never failed for it.
    max_deferral: WholeSeconds = Field(3600, ge=1)
    defer_base: Seconds = Field(5.0, gt=0)
    defer_max: Seconds = Field(60.0, gt=0)
    # A job cut off by the soft-shutdown window (a deploy, a scale-in) goes back to the queue with
    # its attempt given back; past this many cut-offs it can never fit a window, and its run fails.
    max_shutdown_cutoffs: int = Field(10, ge=1)

    # Outages and refusals of the whole fleet (a dependency's error while its own check fails
    # too, mailpipe.pipeline.health): a job that hits one defers without using an attempt. Once
    # this many distinct emails hit one within `pause_window` seconds the stage pauses: its
    # workers stop taking its work, and the dependency's check, once every
    # `pause_probe_interval` seconds, ends the pause when it passes. No run fails for it, however
    # long it lasts; past `outage_alarm_after` seconds the stage's alarm fires. A process keeps a
    # check's verdict `health_cache_seconds`.
    pause_after_emails: int = Field(3, ge=1)
    pause_window: Seconds = Field(60.0, gt=0)
    pause_probe_interval: Seconds = Field(30.0, gt=0)
    outage_alarm_after: Seconds = Field(900.0, gt=0)
    health_cache_seconds: Seconds = Field(5.0, ge=0)

    # Worker liveness: each worker's main process writes a heartbeat with the messages it holds;
    # a worker silent for `worker_dead_after` seconds is dead, and its messages go back to the
    # front of their queue at once instead of after the visibility timeout.
    worker_heartbeat_interval: Seconds = Field(10.0, gt=0)
    worker_dead_after: Seconds = Field(30.0, gt=0)

    # Database connections: a dead or unreachable server fails a statement in seconds, as a
    # transient error, instead of hanging the job until its hard time limit.
    db_connect_timeout: WholeSeconds = Field(5, ge=1)
    # PostgreSQL takes at most 2^31 - 1 ms as a statement's timeout, and libpq as the
    # connection's (tcp_user_timeout: their sum, storage/db.py); Linux 32767 s as TCP_KEEPIDLE.
    db_statement_timeout: int = Field(30, ge=1, le=2_000_000)
    db_keepalives_idle: int = Field(30, ge=1, le=32767)
    # Connections per process (and as many again in a burst): a prefork child runs one job at a
    # time; the model role's threads hold one only for their short transactions, so a few serve
    # dozens of threads.
    db_pool_size: int = Field(2, ge=1)
    # Whether the processes that run jobs (workers and their children) wait for PostgreSQL to
    # put each commit on disk. Everything they write is derived from a stored email and written
    # again by the email's next job; a crash of PostgreSQL can undo the last fraction of a second
    # of it, and the next sweep re-adds those emails (docs/architecture.md). The CLI's writes
    # (stored emails, flags, reopened runs) always wait.
    worker_synchronous_commit: bool = False
    # The database URL reaches PostgreSQL through a pooler in transaction mode (PgBouncer's
    # pool_mode=transaction, RDS Proxy): no server-side prepared statements, and the statement
    # timeout and commit mode set in each transaction instead of at connect (docs/scaling.md,
    # "PostgreSQL connections"). Migrations (`mailpipe db upgrade`) connect to PostgreSQL itself.
    db_transaction_pooling: bool = False

    # Workers.
    worker_concurrency: int = Field(2, ge=1)
    # Messages reserved per child: the running one and the next (why and at what cost:
    # mailpipe/app/config.py). 1 for jobs of minutes.
    worker_prefetch_multiplier: int = Field(2, ge=1)
    # The share of a worker's jobs the bulk lane gets while the live lane has work waiting, and of
    # the fleet's model calls while live ones wait (docs/lanes.md).
    bulk_share: float = Field(0.1, ge=0.0, le=1.0)
    # The shard queues of each lane of each stage that mailboxes share (mailpipe.broker.mailboxes);
    # 0 sends every job to the lane's own queue, as one stream. The same in every process.
    mailbox_queues: int = Field(16, ge=0, le=64)
    # Measured (docs/benchmarks.md): a child grows under 1 MB per 1,000 jobs, and a fresh child's
    # first job costs ~0.2 s; the memory cap is the guard against one pathological document.
    worker_max_tasks_per_child: int = Field(10_000, ge=1)
    worker_max_memory_per_child_kb: int = Field(400 * 1024, ge=10 * 1024)
    soft_shutdown_timeout: Seconds = Field(90.0, ge=0)  # inside ECS's 120 s stopTimeout

    # Parsing limits: an email over any of them is rejected, not retried.
    max_email_bytes: int = Field(50 * 1024 * 1024, ge=1024)
    max_mime_depth: int = Field(25, ge=1)
    max_mime_parts: int = Field(1000, ge=1)
    body_text_max_chars: int = Field(200_000, ge=1000)

    # Documents (attachments converted to text).
    doc_max_bytes: int = Field(25 * 1024 * 1024, ge=1)
    doc_max_per_email: int = Field(100, ge=0)
    doc_max_pages: int = Field(500, ge=1)
    doc_max_uncompressed_bytes: int = Field(200 * 1024 * 1024, ge=1)
    doc_max_zip_entries: int = Field(5_000, ge=1)
    doc_max_zip_ratio: float = Field(200.0, gt=1)
    doc_time_limit: Seconds = Field(30.0, gt=0)
    doc_max_text_chars: int = Field(2_000_000, ge=1000)
    doc_inline_text_bytes: int = Field(64 * 1024, ge=0)  # longer text goes to blob storage

    # Sweeper.
    sweep_interval: Seconds = Field(300.0, gt=0)
    sweep_batch_size: int = Field(1000, ge=1)
    # Open runs already classified count as stalled after this.
    stall_after: WholeSeconds = Field(1800, ge=0)
    max_sweeps: int = Field(3, ge=1)
    beat_lock_timeout: WholeSeconds = Field(60, ge=5)

    # The most emails one operator's reprocess takes (a model call each with a remote model);
    # more only with the override every face names (`reprocess --over-max`, `over_max`).
    reprocess_max: int = Field(10_000, ge=1)

    # Housekeeping (mailpipe.operations.housekeeping), by beat's lock holder.
    housekeeping_interval: Seconds = Field(3600.0, gt=0)  # seconds between passes
    # Closed runs' attempts, sweep reports.
    keep_attempts_days: float = Field(30.0, gt=0, le=LONGEST_DAYS)
    housekeeping_batch: int = Field(1000, ge=1, le=100_000)  # rows per transaction

    # Metrics.
    metrics_namespace: str | None = None  # unset: metrics go to the log
    # Seconds between the fleet's reports (beat).
    metrics_interval: Seconds = Field(60.0, gt=0)
    # A CloudWatch-compatible endpoint (tests); boto3's AWS_ENDPOINT_URL_CLOUDWATCH works too.
    cloudwatch_endpoint_url: str | None = None

    # Flower.
    flower_basic_auth: str | None = None  # "user:password[,user2:password2]"

    # The operator's console and job status API (`mailpipe web`, mailpipe/web/). Who may sign in
    # (HTTP basic auth): "user:password[,user2:password2]", each password plain, a bcrypt hash
    # ($2b$...) or an argon2 hash ($argon2id$...). Viewers read; operators also act. Without any,
    # the console serves loopback only.
    web_host: str = "127.0.0.1"
    web_port: int = Field(8080, ge=1, le=65535)
    web_operators: SecretStr | None = None
    web_viewers: SecretStr | None = None
    # Each statement of the console's and the API's reads is given up past this (milliseconds)
    # and the request answered 503, so that no page holds a database connection and its CPU for
    # the workers' MAILPIPE_DB_STATEMENT_TIMEOUT; the console's actions keep that one.
    web_statement_timeout_ms: int = Field(5000, ge=1)
    # Searches at once in a web process, in all and per user: one more is refused at once (503
    # and 429, with Retry-After), not queued. The searches have as many connections of their own,
    # so that the pages keep theirs (docs/decisions/search-load.md).
    web_searches: int = Field(4, ge=1)
    web_searches_per_user: int = Field(2, ge=1)
    # The API's bearer tokens for machines: `name:role:sha256` entries (web_tokens below).
    web_tokens: SecretStr | None = None
    # The key of the console's CSRF tokens (mailpipe/web/auth.py), at least WEB_SECRET_BYTES;
    # unset, each process draws its own at start, so that two processes behind one address need
    # it set.
    web_secret: SecretStr | None = None
    # The most an API action's JSON body may hold (bytes): a longer one is refused (413) before
    # it is read whole. The longest an action takes, a forget's list of ids, fits some 50,000
    # ids in the default.
    api_body_max_bytes: int = Field(1024 * 1024, ge=1024, le=64 * 1024 * 1024)

    # Logs: `text` (Celery's lines, for a terminal) or `json` (one JSON object per record, with the
    # traceback, task id and email id inside it: mailpipe/app/logs.py). The ECS task definitions
    # set json.
    log_format: Literal["text", "json"] = "text"
    # Health files, touched while the role is healthy; the ECS health checks test their age with a
    # shell test (deploy/README.md). The worker's heartbeat thread touches its file after each
    # heartbeat it wrote to Redis; beat's scheduler touches its file on each tick that reached Redis.
    worker_health_file: Path = Path("/tmp/mailpipe-worker.health")
    beat_health_file: Path = Path("/tmp/mailpipe-beat.health")

    @model_validator(mode="after")
    def _check_labels(self) -> Settings:
        if not self.labels or any(not label.strip() for label in self.labels):
            raise ValueError("MAILPIPE_LABELS must name at least one label, none of them empty")
        repeated = sorted({label for label in self.labels if self.labels.count(label) > 1})
        if repeated:
            raise ValueError(f"MAILPIPE_LABELS names {', '.join(repeated)} more than once")
        return self

    @field_validator("mailbox_model_rates", mode="before")
    @classmethod
    def _check_mailbox_model_rates(cls, value: object) -> object:
        # Checked here, entry by entry, so that no error names a mailbox (pydantic's own would
        # put the name in the error's location). Pairs are the checked settings, copied.
        if isinstance(value, tuple):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                'must be a JSON object of mailbox names to calls per second: {"name": 2.5}'
            )
        for number, (name, rate) in enumerate(value.items(), start=1):
            if not isinstance(name, str) or not name.strip() or not name.isprintable():
                raise ValueError(f"entry {number}'s mailbox name is empty or not printable")
            if (
                isinstance(rate, bool)
                or not isinstance(rate, int | float)
                or not 0 <= rate < float("inf")
            ):
                raise ValueError(f"entry {number}'s rate is not a number of calls per second >= 0")
        return tuple(value.items())

    def mailbox_model_rate_of(self, mailbox: str) -> float:
        """The ceiling on model calls per second of the mailbox `mailbox` (its shown name); 0
        when it has none."""
        return dict(self.mailbox_model_rates).get(mailbox, self.mailbox_model_rate)

    @model_validator(mode="after")
    def _check_model_batch(self) -> Settings:
        if not self.model_batch_min <= self.model_batch_size <= self.model_batch_max:
            raise ValueError(
                "MAILPIPE_MODEL_BATCH_SIZE must be from MAILPIPE_MODEL_BATCH_MIN to "
                "MAILPIPE_MODEL_BATCH_MAX"
            )
        if self.model_batch == "on" and self.model_backend != "bedrock":
            raise ValueError("MAILPIPE_MODEL_BATCH=on needs MAILPIPE_MODEL_BACKEND=bedrock")
        return self

    @property
    def model_batch_on(self) -> bool:
        """Whether the bulk lane's model stage goes through batches: as set, or unset, with the
        `bedrock` backend and a role for Bedrock's batch jobs."""
        if self.model_batch is not None:
            return self.model_batch == "on"
        return self.model_backend == "bedrock" and bool(self.model_batch_role_arn)

    def model_batch_leader_problem(self) -> str | None:
        """Why beat's leader could not form batches with these settings; None when it can."""
        if not self.model_batch_on:
            return None
        if not self.blob_url.startswith("s3://"):
            return "model batches need an s3:// MAILPIPE_BLOB_URL: Bedrock reads and writes them"
        if not self.model_batch_role_arn:
            return "model batches need MAILPIPE_MODEL_BATCH_ROLE_ARN, the role Bedrock assumes"
        return None

    @model_validator(mode="after")
    def _check_web_users(self) -> Settings:
        web_tokens(self.web_tokens)
        operators = dict(web_users(self.web_operators, "MAILPIPE_WEB_OPERATORS"))
        viewers = dict(web_users(self.web_viewers, "MAILPIPE_WEB_VIEWERS"))
        both = sorted(set(operators) & set(viewers))
        if both:
            raise ValueError(
                f"MAILPIPE_WEB_OPERATORS and MAILPIPE_WEB_VIEWERS both name {', '.join(both)}: "
                "an operator can read already; name each user once"
            )
        return self

    @model_validator(mode="after")
    def _check_web_searches(self) -> Settings:
        if self.web_searches_per_user > self.web_searches:
            raise ValueError(
                f"MAILPIPE_WEB_SEARCHES_PER_USER ({self.web_searches_per_user}) must not exceed "
                f"MAILPIPE_WEB_SEARCHES ({self.web_searches}): a user's searches would meet the "
                "bound in all first, and their own would never be reached"
            )
        return self

    @field_validator("web_secret")
    @classmethod
    def _check_web_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().encode()) < WEB_SECRET_BYTES:
            raise ValueError(
                f"must be at least {WEB_SECRET_BYTES} bytes: it signs the console's CSRF tokens, "
                "and a shorter one (an empty one, a word) can be found offline from one token, "
                "then any token forged. Leave it unset to draw one at start, or make one with "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    # Refused here, not only when a worker starts: every process builds Redis clients from this
    # URL with from_url (the worker, beat, the CLI, upstream code's enqueue), and each would
    # otherwise fail later, with redis-py's bare "must specify one of the following schemes".
    @model_validator(mode="after")
    def _check_broker_url(self) -> Settings:
        scheme = urlsplit(self.broker_url).scheme
        if scheme not in BROKER_SCHEMES:
            raise ValueError(
                "MAILPIPE_BROKER_URL must be a redis:// or rediss:// URL, not "
                f"{f'{scheme}://' if scheme else 'one without a scheme'}: kombu and mailpipe's "
                "own Redis clients (leases, markers, heartbeats: redis-py's Redis.from_url) both "
                "connect with it, and from_url cannot follow a Sentinel; a Unix socket is "
                "unix:// to redis-py but redis+socket:// to kombu"
            )
        return self

    @model_validator(mode="after")
    def _check_time_budget(self) -> Settings:
        if self.task_soft_time_limit >= self.task_time_limit:
            raise ValueError(
                "MAILPIPE_TASK_SOFT_TIME_LIMIT must be below MAILPIPE_TASK_TIME_LIMIT so that a job "
                "can record its error before it is killed"
            )
        if self.visibility_timeout <= self.task_time_limit + self.retry_backoff_max:
            raise ValueError(
                "MAILPIPE_VISIBILITY_TIMEOUT must exceed MAILPIPE_TASK_TIME_LIMIT + "
                f"MAILPIPE_RETRY_BACKOFF_MAX ({self.task_time_limit} + {self.retry_backoff_max}), "
                "or the broker redelivers jobs that are still running or waiting to retry"
            )
        if self.worker_dead_after < 2 * self.worker_heartbeat_interval:
            raise ValueError(
                "MAILPIPE_WORKER_DEAD_AFTER must be at least twice "
                "MAILPIPE_WORKER_HEARTBEAT_INTERVAL, or one late heartbeat declares a live worker "
                "dead and its jobs are run twice"
            )
        if self.dedup_ttl < 2 * self.sweep_interval:
            raise ValueError(
                "MAILPIPE_DEDUP_TTL must be at least twice MAILPIPE_SWEEP_INTERVAL, so that sweeps "
                "refresh the markers of waiting jobs before they lapse"
            )
        if self.defer_max >= self.visibility_timeout - self.task_time_limit:
            raise ValueError(
                f"MAILPIPE_DEFER_MAX ({self.defer_max:g} s) must stay below "
                "MAILPIPE_VISIBILITY_TIMEOUT - MAILPIPE_TASK_TIME_LIMIT, or a deferred job's "
                "message is delivered twice while it waits"
            )
        if self.retry_backoff_base > self.retry_backoff_max:
            raise ValueError(
                f"MAILPIPE_RETRY_BACKOFF_BASE ({self.retry_backoff_base:g} s) must not exceed "
                f"MAILPIPE_RETRY_BACKOFF_MAX ({self.retry_backoff_max} s): every backoff would be "
                "the maximum"
            )
        if self.lease_ttl >= self.max_deferral:
            raise ValueError(
                f"MAILPIPE_LEASE_TTL ({self.lease_ttl} s) must be below MAILPIPE_MAX_DEFERRAL "
                f"({self.max_deferral} s): a delivery that finds the lease of a worker that died "
                "on another host defers until it lapses, and would fail its run first"
            )
        return self

    def window_warnings(self) -> list[str]:
        """Windows that work together but defeat a mechanism: a worker logs each at start.

        Not refused, because a test may shrink one window on purpose to reach a path (a visibility
        timeout of a few seconds, a lease longer than a job), but never right in production.
        """
        warnings = []
        if self.worker_dead_after >= self.visibility_timeout:
            warnings.append(
                f"MAILPIPE_WORKER_DEAD_AFTER ({self.worker_dead_after:g} s) is not below "
                f"MAILPIPE_VISIBILITY_TIMEOUT ({self.visibility_timeout} s): the broker puts a "
                "dead worker's messages back before the heartbeat would"
            )
        if self.lease_ttl >= self.task_time_limit:
            warnings.append(
                f"MAILPIPE_LEASE_TTL ({self.lease_ttl} s) is not below MAILPIPE_TASK_TIME_LIMIT "
                f"({self.task_time_limit} s): a job killed on another host keeps its email "
                "blocked for longer than the job itself could have run"
            )
        if self.lease_ttl >= self.visibility_timeout:
            warnings.append(
                f"MAILPIPE_LEASE_TTL ({self.lease_ttl} s) is not below "
                f"MAILPIPE_VISIBILITY_TIMEOUT ({self.visibility_timeout} s): a message the broker "
                "redelivers finds the dead delivery's lease still held"
            )
        return warnings

    def database_tls_warnings(self) -> list[str]:
        """A PostgreSQL server off this machine reached without TLS required: the emails would
        cross the network in clear, and nothing checks who answers. A worker and `mailpipe db
        upgrade` print it at start."""
        url = urlsplit(self.database_url)
        if url.scheme.split("+")[0] not in ("postgresql", "postgres"):
            return []
        host = url.hostname or ""
        if not host or host.startswith("/") or is_loopback(host):  # a Unix socket, or loopback
            return []
        sslmode = parse_qs(url.query).get("sslmode", [""])[-1]
        if sslmode in TLS_SSLMODES:
            return []
        return [
            f"MAILPIPE_DATABASE_URL reaches PostgreSQL at {host} with sslmode={sslmode or 'prefer'}:"
            " the connection may be unencrypted. Add sslmode=verify-full and sslrootcert=<the "
            "server's CA bundle> (deploy/README.md), or at least sslmode=require"
        ]

    @property
    def max_attempts(self) -> int:
        """The first try and `max_retries` retries."""
        return self.max_retries + 1


def web_users(value: SecretStr | None, variable: str) -> list[tuple[str, str]]:
    """The (user, password) pairs of a MAILPIPE_WEB_OPERATORS or _VIEWERS value.

    Entries are separated by commas; a piece without a colon continues the password before it,
    so that an argon2 hash keeps its parameters (`$argon2id$v=19$m=65536,t=3,p=4$...`). Errors
    name the variable and the entry's position, never a password.
    """
    if value is None or not value.get_secret_value().strip():
        return []
    entries: list[str] = []
    for piece in value.get_secret_value().split(","):
        if ":" in piece or not entries:
            entries.append(piece)
        else:
            entries[-1] += "," + piece
    users: list[tuple[str, str]] = []
    for number, entry in enumerate(entries, start=1):
        user, _, password = entry.partition(":")
        user = user.strip()
        if not user or not password:
            raise ValueError(
                f"{variable}: entry {number} is not user:password (a user name, a colon, then a "
                "password or its bcrypt or argon2 hash)"
            )
        if user in dict(users):
            raise ValueError(f"{variable} names the user {user} more than once")
        users.append((user, password))
    return users


# The roles a token may have, as the console's users: a viewer reads, an operator also acts.
TOKEN_ROLES = ("viewer", "operator")


def web_tokens(value: SecretStr | None) -> list[tuple[str, str, str]]:
    """The (name, role, SHA-256 hex) entries of MAILPIPE_WEB_TOKENS: `name:role:sha256`, comma
    separated; the hash is of the token itself, which is random (`mailpipe web-token` makes
    one), so one SHA-256 keeps it as safe as a password hash does a password. Errors name the
    entry's position, never a hash."""
    if value is None or not value.get_secret_value().strip():
        return []
    tokens: list[tuple[str, str, str]] = []
    for number, entry in enumerate(value.get_secret_value().split(","), start=1):
        parts = [part.strip() for part in entry.split(":")]
        name, role, digest = parts if len(parts) == 3 else ("", "", "")
        if not name or role not in TOKEN_ROLES or len(digest) != 64:
            raise ValueError(
                f"MAILPIPE_WEB_TOKENS: entry {number} is not name:role:sha256 (a name, viewer "
                "or operator, and the token's SHA-256 in 64 hex digits)"
            )
        try:
            bytes.fromhex(digest)
        except ValueError:
            raise ValueError(
                f"MAILPIPE_WEB_TOKENS: entry {number}'s SHA-256 is not 64 hex digits"
            ) from None
        if name in {t[0] for t in tokens}:
            raise ValueError(f"MAILPIPE_WEB_TOKENS names the token {name} more than once")
        tokens.append((name, role, digest.lower()))
    return tokens


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()
