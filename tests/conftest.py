"""Real services for the tests that need them: the local Redis and PostgreSQL, and an S3 server
on loopback.

The environment below is set before any mailpipe module reads its settings. A service that is not
there fails the run with a message that says how to start it; nothing is skipped. The services
themselves are the ones the benchmarks use too (`tests/support/services.py`).

Tests of pure code need none. A module whose tests need the services says so itself, with
`pytestmark = pytest.mark.services`; `pytest -m "not services"` runs the quick tier with Redis
and PostgreSQL stopped. A test that uses the services without the mark stops the run at
collection, naming it.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from mailpipe.cli.demo.servers import free_port
from tests.support.database import clean
from tests.support.paths import REPO
from tests.support.services import Database, S3Server, delete_prefix

RUN_ID = f"{os.getpid()}"
PG_ADMIN_URL = os.environ.get(
    "MAILPIPE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("MAILPIPE_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
DATABASE = Database(PG_ADMIN_URL, f"mailpipe_test_{RUN_ID}")
S3_PORT = free_port()
S3_BUCKET = "mailpipe-test"

TEST_ENV = {
    "MAILPIPE_DATABASE_URL": DATABASE.url,
    "MAILPIPE_BROKER_URL": REDIS_URL,
    "MAILPIPE_BLOB_URL": f"s3://{S3_BUCKET}/blobs",
    "MAILPIPE_S3_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}",
    "MAILPIPE_QUEUE": "mailpipe",
    # Every key of this run, kombu's included, lives under this prefix: test runs sharing the
    # machine's Redis, and pytest-xdist's processes of one run, never see each other's jobs.
    "MAILPIPE_REDIS_PREFIX": f"test{RUN_ID}:",
    # Short windows so that retries, leases and redeliveries happen within a test.
    "MAILPIPE_TASK_SOFT_TIME_LIMIT": "20",
    "MAILPIPE_TASK_TIME_LIMIT": "25",
    "MAILPIPE_RETRY_BACKOFF_BASE": "0.5",
    "MAILPIPE_RETRY_BACKOFF_MAX": "4",
    "MAILPIPE_DEFER_BASE": "0.5",
    "MAILPIPE_DEFER_MAX": "2",
    "MAILPIPE_HEALTH_CACHE_SECONDS": "0.5",
    "MAILPIPE_VISIBILITY_TIMEOUT": "40",
    "MAILPIPE_LEASE_TTL": "6",
    "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": "5",
    # Workers read the model-calls flag on every job: a test switches it and sends a job at once.
    "MAILPIPE_MODEL_CALLS_CACHE_SECONDS": "0",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
os.environ.update(TEST_ENV)


SERVICES_MARK = re.compile(r"^pytestmark = .*\bpytest\.mark\.services\b", re.MULTILINE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that reaches the services fixture (through `res`, `fleet`, a worker...) must be
    marked, or the quick tier would run it without them."""
    unmarked = [
        item.nodeid
        for item in items
        if "services" in item.fixturenames and item.get_closest_marker("services") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that use Redis, PostgreSQL or the S3 server without saying so (add "
            "`pytestmark = pytest.mark.services` to their module): " + ", ".join(unmarked)
        )


def _quick_tier(config: pytest.Config) -> bool:
    return config.getoption("markexpr", "") == "not services"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The quick tier does not import the modules marked `services`, whose every test it would
    deselect (the services' own imports take seconds in each process): their mark is read from
    their text."""
    if not _quick_tier(config) or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    return True if SERVICES_MARK.search(collection_path.read_text()) else None


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is loaded by now (modules, classes, the collected tests) lives to the end of the run:
    frozen, it is left out of the full garbage collections that a test's garbage (a botocore
    client's tens of thousands of objects) sets off."""
    gc.collect()
    gc.freeze()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Redis and PostgreSQL are there, or the run stops with how to start them (not for the
    quick tier, which needs neither).

    Checked before pytest-xdist starts its worker processes (in each of them too): a worker
    that stopped the run itself would leave only xdist's report of a crash.
    """
    if _quick_tier(session.config):
        return
    import psycopg
    import redis

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError as exc:
        pytest.exit(
            f"Redis is not reachable at {REDIS_URL} ({exc}). Start it: redis-server "
            "--daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' --appendonly no",
            returncode=3,
        )
    try:
        psycopg.connect(PG_ADMIN_URL, connect_timeout=10).close()
    except psycopg.OperationalError as exc:
        pytest.exit(
            f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({exc}). Start it: "
            "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
            returncode=3,
        )
    if _runs(session.config, BROWSER_TEST) and not os.access(CHROMIUM, os.X_OK):
        pytest.exit(
            f"headless Chromium is missing at {CHROMIUM}, which the console's browser test "
            "drives: apt-get install -y chromium",
            returncode=3,
        )


# The one test that needs a program besides Python, Redis and PostgreSQL: Debian's Chromium.
BROWSER_TEST = "tests/integration/test_web_browser.py"
CHROMIUM = Path("/usr/bin/chromium")


def _runs(config: pytest.Config, path: str) -> bool:
    """Whether the run's arguments (the test paths when none) reach `path`."""
    args = config.args or ["tests"]
    wanted = (REPO / path).resolve()
    for arg in args:
        named = Path(arg.split("::")[0])
        named = named if named.is_absolute() else Path(config.invocation_params.dir) / named
        if wanted == named.resolve() or named.resolve() in wanted.parents:
            return True
    return False


@pytest.fixture(autouse=True)
def _services_when_marked(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("services") is not None:
        request.getfixturevalue("services")


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Create and migrate this run's database, start the S3 server, clean up at the end."""
    delete_prefix(REDIS_URL, TEST_ENV["MAILPIPE_REDIS_PREFIX"])
    DATABASE.create()

    from mailpipe.storage.migrate import upgrade

    upgrade(DATABASE.url)
    s3 = S3Server(tmp_path_factory.mktemp("s3") / "moto.log", port=S3_PORT)
    try:
        s3.start(S3_BUCKET)
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)  # every test of the process errors with it
    try:
        yield
    finally:
        s3.stop()
        from mailpipe.resources import get_resources

        get_resources().close()
        delete_prefix(REDIS_URL, TEST_ENV["MAILPIPE_REDIS_PREFIX"])
        DATABASE.drop()


@pytest.fixture
def res(services: None):  # type: ignore[no-untyped-def]
    """This process's Resources on clean tables and no Redis key of this run."""
    from mailpipe.resources import get_resources

    res = get_resources()
    clean(res)
    return res
