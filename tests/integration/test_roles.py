"""Every role starts exactly as written, and its health check passes.

- Each line of the Procfile is started verbatim through `sh -c`, from the repository root (where
  a Procfile runner starts it), with an environment of the test's own: its own Redis key prefix,
  database, blob folder, health files and loopback port.
- The README's local fleet (`mailpipe db upgrade && honcho start ...`) is started as written
  through `sh -c`, from the repository root, and stopped with SIGTERM to its process group, as a
  terminal's Ctrl-C stops it: nothing it started may be left.
- Each ECS task definition's command is started as the container would start it (exec form, the
  image's ENV, the task's `environment`, its `secrets` given values of the test's own and nothing
  else), outside Docker: the image's paths are mapped to this checkout's (the Dockerfile's COPY
  destinations, /opt/venv/bin, the /tmp volume and the working directory) and Flower's port 5555
  to a free one. Its health check command runs the same way. Two things differ from the task and
  are said where they are set: the processes run as root here (the task runs as 10001), so
  Celery's warning about root is silenced; and beat's sweep and report intervals are 2 s instead
  of 300 s and 60 s.

A role is ready when a worker (the CPU stage's or the model role's) answers a ping and consumes
exactly its queues (`celery inspect active_queues`), beat has put a sweep on the control queue
and sent the fleet's metrics to CloudWatch (moto),
Flower answers 401 without credentials and 200 with them, and release exits 0 having migrated.
The two workers' task definitions also process an email together, each running its own stage.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import psutil
import pytest
import redis
import requests
from sqlalchemy import func, select

import mailpipe
from mailpipe.broker.queues import Lane, Stage, control_queue, family, stage_queue
from mailpipe.cli.demo.fleet import control_app
from mailpipe.cli.demo.servers import free_port
from mailpipe.coordination import redis_keys
from mailpipe.settings import Settings, get_settings
from mailpipe.storage import flags
from mailpipe.storage.models import Classification, EmailLabel, SweepReport
from tests.conftest import PG_ADMIN_URL, REDIS_URL, S3_PORT
from tests.support.bedrock_server import BedrockServer, invoices
from tests.support.emails import raw_email
from tests.support.fleet import enqueue_in
from tests.support.paths import REPO
from tests.support.services import Database
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

BIN = Path(sys.executable).parent
DEPLOY = REPO / "deploy"
ROOT_WARNING = "ignore:You're running the worker with superuser privileges"
# The worker's health check before this change (deploy/ecs/worker.json), for the CPU figures.
OLD_WORKER_CHECK = (
    'celery -A mailpipe inspect ping --destination "celery@$(hostname)" --timeout 10 > /dev/null'
)
POOLS = {
    "worker": "celery.concurrency.prefork:TaskPool",
    "model": "celery.concurrency.thread:TaskPool",
}
# Node names as Celery expands them on this machine: the worker's default, the model role's own.
WORKER_NODE = f"celery@{socket.gethostname()}"
MODEL_NODE = f"model@{socket.gethostname()}"


# --- processes ---------------------------------------------------------------------------------


class Role:
    """One role's process, its output in a file."""

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, group: bool
    ) -> None:
        self.log_path = log_path
        self.group = group  # stopped as a Procfile runner stops it: SIGTERM to its process group
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        assert self.alive(), f"exited with {self.process.returncode}:\n{self.output()[-4000:]}"

    def stop(self, timeout: float = 60) -> int | None:
        if self.alive():
            if self.group:
                os.killpg(self.process.pid, signal.SIGTERM)
            else:
                self.process.send_signal(signal.SIGTERM)  # tini passes it to the main process
            try:
                code = self.process.wait(timeout)
                # `sh -c` exits at the signal; what it started may still be closing its files.
                if self.group_gone(timeout):
                    return code
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.wait(30)

    def group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False


def wait_worker_ready(role: Role, env: dict[str, str], nodename: str) -> None:
    app = control_app(env)

    def answers() -> bool:
        role.check_alive()
        return bool(app.control.ping(destination=[nodename], timeout=1))

    wait_for(answers, 90, f"{nodename} to answer a ping")


def inspect(env: dict[str, str], nodename: str, what: str) -> Any:
    """One `celery inspect <what>` answer of `nodename`."""
    replies = getattr(control_app(env).control.inspect([nodename], timeout=5), what)()
    assert replies and nodename in replies, f"{nodename} did not answer {what}: {replies}"
    return replies[nodename]


def consumed_queues(env: dict[str, str], nodename: str) -> list[str]:
    return sorted(queue["name"] for queue in inspect(env, nodename, "active_queues"))


def queues_of_the_roles(env: dict[str, str]) -> dict[str, list[str]]:
    """What each worker must consume, derived from `env`'s MAILPIPE_QUEUE as the app derives it."""
    settings = Settings.model_construct(
        queue=env.get("MAILPIPE_QUEUE", Settings.model_fields["queue"].default)
    )

    def lanes_of(stage: Stage) -> list[str]:
        """The stage's lane queues, each with its mailboxes' shards."""
        return [q for lane in Lane for q in family(stage_queue(stage, settings, lane), settings)]

    return {
        "worker": sorted([*lanes_of(Stage.CPU), control_queue(settings)]),
        "model": sorted(lanes_of(Stage.MODEL)),
    }


def wait_beat_fired(role: Role, env: dict[str, str]) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    control = f"{env['MAILPIPE_REDIS_PREFIX']}mailpipe.control"

    def fired() -> bool:
        role.check_alive()
        return bool(client.llen(control))

    wait_for(fired, 60, "beat to put a sweep on the control queue")


def answering(url: str) -> Callable[[], bool]:
    """A wait's condition: `url` answers 200; a refused connection is not yet."""

    def answers() -> bool:
        try:
            return requests.get(url, timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    return answers


def wait_flower_ready(role: Role, port: int, auth: tuple[str, str]) -> None:
    url = f"http://127.0.0.1:{port}"

    wait_for(alive_and(role, answering(f"{url}/healthcheck")), 60, "Flower to answer /healthcheck")
    assert requests.get(f"{url}/", timeout=5).status_code == 401
    assert requests.get(f"{url}/api/workers", auth=(auth[0], "wrong"), timeout=5).status_code == 401
    assert requests.get(f"{url}/", auth=auth, timeout=5).status_code == 200


def migrated(url: str) -> bool:
    from mailpipe.storage.db import Database as Engine
    from mailpipe.storage.migrate import SchemaMissing, check_schema

    database = Engine(url)
    try:
        check_schema(database)
        return True
    except SchemaMissing:
        return False
    finally:
        database.engine.dispose()


def run_health_check(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """ECS's healthCheck.command: CMD-SHELL through /bin/sh -c, CMD as an exec."""
    kind, *rest = command
    argv = ["/bin/sh", "-c", rest[0]] if kind == "CMD-SHELL" else rest
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)


def cpu_ms(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    """CPU (user + system) of one run of `argv` and everything it starts, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return used * 1000, code


def json_lines(output: str) -> list[dict]:
    """Every line of `output` as a JSON record; fails on the first line that is not one."""
    records = []
    for number, line in enumerate(output.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"line {number} is not JSON: {line[:300]!r}")
        assert isinstance(record, dict) and {"time", "level", "logger", "message"} <= set(record)
        records.append(record)
    return records


@pytest.fixture
def database() -> Iterator[Database]:
    """A database of the test's own, not migrated."""
    db = Database(PG_ADMIN_URL, f"mailpipe_roles_{os.getpid()}_{uuid.uuid4().hex[:8]}").create()
    try:
        yield db
    finally:
        db.drop()


@pytest.fixture
def migrated_database(database: Database) -> Database:
    from mailpipe.storage.migrate import upgrade

    upgrade(database.url)
    return database


def email(tag: str) -> bytes:
    return raw_email(
        tag,
        to="b@example.org",
        body=f"Hello {tag}",
        message_id=f"{tag}.{uuid.uuid4().hex}@example.org",
    )


def own_prefix() -> str:
    return f"{os.environ['MAILPIPE_REDIS_PREFIX']}roles{uuid.uuid4().hex[:8]}:"


# --- the Procfile ------------------------------------------------------------------------------


def procfile() -> dict[str, str]:
    lines = (REPO / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if line.strip())


def test_the_procfile_names_every_role():
    assert set(procfile()) == {"release", "worker", "model", "beat", "flower", "web"}


@pytest.fixture
def procfile_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env["MAILPIPE_REDIS_PREFIX"] = own_prefix()
    env["MAILPIPE_BLOB_URL"] = f"file://{tmp_path / 'blobs'}"
    env["MAILPIPE_WORKER_HEALTH_FILE"] = str(tmp_path / "worker.health")
    env["MAILPIPE_BEAT_HEALTH_FILE"] = str(tmp_path / "beat.health")
    env["MAILPIPE_WORKER_HEARTBEAT_INTERVAL"] = "2"
    env["MAILPIPE_SWEEP_INTERVAL"] = "2"
    env["MAILPIPE_FLOWER_BASIC_AUTH"] = f"ops:{uuid.uuid4().hex}"
    env["FLOWER_PORT"] = str(free_port())
    return env


def start_procfile_line(role: str, env: dict[str, str], tmp_path: Path) -> Role:
    return Role(["sh", "-c", procfile()[role]], env, REPO, tmp_path / f"{role}.log", group=True)


def file_test(path: str) -> list[str]:
    """The shell test the ECS health checks make, on `path`."""
    return ["CMD-SHELL", f'test -n "$(find {path} -mmin -1)"']


def test_procfile_release_migrates(procfile_env, database, tmp_path) -> None:  # type: ignore[no-untyped-def]
    procfile_env["MAILPIPE_DATABASE_URL"] = database.url
    release = start_procfile_line("release", procfile_env, tmp_path)
    assert release.process.wait(120) == 0, release.output()
    assert migrated(database.url)


@pytest.mark.parametrize("role", ["worker", "model"])
def test_procfile_workers_consume_their_queues_and_touch_their_health_file(  # type: ignore[no-untyped-def]
    role, procfile_env, migrated_database, tmp_path
) -> None:
    """The CPU stage's worker takes the email and control queues, never the model's; the model
    role takes only the model queue, on 32 threads. The names follow MAILPIPE_QUEUE, here one of
    the test's own."""
    procfile_env["MAILPIPE_DATABASE_URL"] = migrated_database.url
    procfile_env["MAILPIPE_QUEUE"] = f"roles{uuid.uuid4().hex[:8]}"
    health = Path(procfile_env["MAILPIPE_WORKER_HEALTH_FILE"])
    nodename = {"worker": WORKER_NODE, "model": MODEL_NODE}[role]
    worker = start_procfile_line(role, procfile_env, tmp_path)
    try:
        wait_worker_ready(worker, procfile_env, nodename)
        # Its start line names the release, as `mailpipe --version` does.
        assert f"mailpipe {mailpipe.__version__}: worker {nodename} ready" in worker.output()
        assert consumed_queues(procfile_env, nodename) == queues_of_the_roles(procfile_env)[role]
        stats = inspect(procfile_env, nodename, "stats")
        pool = stats["pool"]
        assert pool["implementation"] == POOLS[role]
        if role == "model":
            assert pool["max-concurrency"] == 32
            # One message reserved per thread, so that a live call waits behind no bulk one.
            assert stats["prefetch_count"] == 32
        wait_for(health.exists, 30, "the worker's health file")
        first = health.stat().st_mtime
        wait_for(lambda: health.stat().st_mtime > first, 30, "the heartbeat to touch it again")
        check = run_health_check(file_test(str(health)), procfile_env)
        assert check.returncode == 0, check.stderr
    finally:
        worker.stop()
    # A normal stop says so, whatever Celery names it.
    assert "worker: warm shutdown at SIGTERM" in worker.output(), worker.output()[-3000:]
    # The check tests the age: a file last touched over a minute ago fails it.
    stale = time.time() - 61
    os.utime(health, (stale, stale))
    assert run_health_check(file_test(str(health)), procfile_env).returncode != 0


def test_procfile_beat_fires_and_touches_its_health_file(procfile_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    health = Path(procfile_env["MAILPIPE_BEAT_HEALTH_FILE"])
    # Beat writes its schedule into its working directory, the repository root (ignored by git).
    before = set(REPO.glob("celerybeat-schedule*"))
    beat = start_procfile_line("beat", procfile_env, tmp_path)
    try:
        wait_beat_fired(beat, procfile_env)
        wait_for(health.exists, 30, "beat's health file")
        first = health.stat().st_mtime
        wait_for(lambda: health.stat().st_mtime > first, 30, "beat to touch it again")
        assert run_health_check(file_test(str(health)), procfile_env).returncode == 0
    finally:
        beat.stop()
        for left in set(REPO.glob("celerybeat-schedule*")) - before:
            left.unlink()


def test_procfile_flower_asks_for_its_credentials(procfile_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = int(procfile_env["FLOWER_PORT"])
    user, password = procfile_env["MAILPIPE_FLOWER_BASIC_AUTH"].split(":")
    flower = start_procfile_line("flower", procfile_env, tmp_path)
    try:
        wait_flower_ready(flower, port, (user, password))
    finally:
        flower.stop()


def test_procfile_web_answers_its_health_check_and_stops_at_sigterm(  # type: ignore[no-untyped-def]
    procfile_env, tmp_path
) -> None:
    """`mailpipe web` as the Procfile has it, on the port the environment gives it: /healthz
    answers without credentials; with no users, on loopback, the local operator reads the API
    (as Flower is open on loopback); SIGTERM ends it after uvicorn's graceful shutdown."""
    procfile_env["MAILPIPE_WEB_PORT"] = str(free_port())
    url = f"http://127.0.0.1:{procfile_env['MAILPIPE_WEB_PORT']}"
    web = start_procfile_line("web", procfile_env, tmp_path)
    try:
        wait_for(alive_and(web, answering(f"{url}/healthz")), 60, "the console to answer /healthz")
        queues = requests.get(f"{url}/api/queues", timeout=10)
        assert queues.status_code == 200, queues.text
        assert queues.json()["queues"]["email"]["name"] == "mailpipe"
    finally:
        web.stop()
    assert "Application shutdown complete" in web.output(), web.output()[-3000:]


# --- the README's local fleet ------------------------------------------------------------------


def readme_fleet_command() -> str:
    """The README's command line that starts the local fleet, as written."""
    blocks = re.findall(r"```console\n(.*?)```", (REPO / "README.md").read_text(), re.DOTALL)
    (command,) = [line for block in blocks for line in block.splitlines() if "honcho start" in line]
    return command


def fleet_processes(env: dict[str, str]) -> list[psutil.Process]:
    """Every live process started with `env`'s Redis key prefix: whatever the fleet started,
    wherever it was reparented."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("MAILPIPE_REDIS_PREFIX") == env["MAILPIPE_REDIS_PREFIX"]:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def alive_and(role: Role, ready: Callable[[], bool]) -> Callable[[], bool]:
    """`ready`, failing at once with the role's output if the role has exited."""

    def check() -> bool:
        role.check_alive()
        return ready()

    return check


def sweeps_reported(url: str) -> int:
    from mailpipe.storage.db import Database as Engine

    database = Engine(url)
    try:
        with database.session() as session:
            return session.scalar(select(func.count()).select_from(SweepReport)) or 0
    finally:
        database.engine.dispose()


def test_the_readme_fleet_starts_every_role_and_stops_at_sigterm(
    procfile_env, database, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """The README's `mailpipe db upgrade && honcho start ...` through `sh -c`, from the repository
    root, on a database not yet migrated and without Flower's credentials (loopback): the schema
    is migrated, each worker answers a ping and consumes its queues, beat holds the beat lock and
    its sweeps run, Flower and the console answer. SIGTERM to the process group, as a terminal's Ctrl-C, stops
    every process the fleet started, and none is left."""
    env = {k: v for k, v in procfile_env.items() if k != "MAILPIPE_FLOWER_BASIC_AUTH"}
    env["MAILPIPE_DATABASE_URL"] = database.url
    env["MAILPIPE_WEB_PORT"] = str(free_port())
    beat_lock = env["MAILPIPE_REDIS_PREFIX"] + redis_keys.beat_lock().removeprefix(
        get_settings().redis_prefix
    )
    client = redis.Redis.from_url(REDIS_URL)
    flower = f"http://127.0.0.1:{env['FLOWER_PORT']}"
    before = set(REPO.glob("celerybeat-schedule*"))
    fleet = Role(
        ["sh", "-c", readme_fleet_command()], env, REPO, tmp_path / "fleet.log", group=True
    )
    try:
        wait_for(alive_and(fleet, lambda: migrated(database.url)), 120, "the schema")
        for role, nodename in (("worker", WORKER_NODE), ("model", MODEL_NODE)):
            wait_worker_ready(fleet, env, nodename)
            assert consumed_queues(env, nodename) == queues_of_the_roles(env)[role]
        wait_for(alive_and(fleet, lambda: bool(client.exists(beat_lock))), 60, "beat's lock")
        wait_for(alive_and(fleet, lambda: sweeps_reported(database.url) >= 3), 60, "beat's sweeps")
        wait_for(
            alive_and(fleet, answering(f"{flower}/healthcheck")),
            60,
            "Flower to answer /healthcheck",
        )
        assert requests.get(f"{flower}/", timeout=5).status_code == 200
        console = f"http://127.0.0.1:{env['MAILPIPE_WEB_PORT']}"
        wait_for(alive_and(fleet, answering(f"{console}/healthz")), 60, "the console to answer")
        # No users on loopback: the local operator's console, reading the fleet's database.
        assert requests.get(f"{console}/api/jobs/1", timeout=5).status_code == 404
        started = fleet_processes(env)
        commands = [" ".join(process.cmdline()) for process in started]
        for part in ("honcho start", "--pool=prefork", "--pool=threads", "beat", "flower", "web"):
            assert any(part in command for command in commands), commands
        # As a terminal's Ctrl-C: honcho passes SIGTERM to each role's process group.
        os.killpg(fleet.process.pid, signal.SIGTERM)
        fleet.process.wait(60)  # the shell, at once; then honcho, once every role has stopped
        assert fleet.group_gone(60), fleet.output()[-4000:]
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], [process.cmdline() for process in alive]
        assert fleet_processes(env) == []
    finally:
        fleet.stop()
        for left in set(REPO.glob("celerybeat-schedule*")) - before:
            left.unlink()


# --- the ECS task definitions ------------------------------------------------------------------


def task_definition(role: str) -> dict:
    (container,) = json.loads((DEPLOY / "ecs" / f"{role}.json").read_text())["containerDefinitions"]
    return container


def dockerfile_final_stage() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


class Image:
    """The image's paths, mapped to this checkout's and to a folder of the test's own."""

    def __init__(self, root: Path, port: int) -> None:
        stage = dockerfile_final_stage()
        (workdir,) = [v for k, v in stage if k == "WORKDIR"]
        self.workdir = root / "workdir"
        self.tmp = root / "tmp"
        self.workdir.mkdir(parents=True)
        self.tmp.mkdir(parents=True)
        self.port = port
        self.paths = {
            workdir: str(self.workdir),
            "/opt/venv/bin": str(BIN),
            "/tmp/": f"{self.tmp}/",
        }
        # Every file the final stage copies from the build context, at its destination.
        for keyword, value in stage:
            if keyword == "COPY" and "--from" not in value:
                source, destination = value.split()
                self.paths[destination] = str(REPO / source)
        self.env = {"LANG": "C.UTF-8", "HOME": str(self.workdir)}
        for keyword, value in stage:
            if keyword == "ENV":
                for pair in shlex.split(value):
                    name, _, setting = pair.partition("=")
                    setting = setting.replace("$PATH", "/usr/local/bin:/usr/bin:/bin")
                    self.env[name] = self.map(setting)

    def map(self, text: str) -> str:
        # In one pass, longest image path first: a local path that itself holds an image path (a
        # checkout under /tmp/) must not be mapped a second time.
        image_paths = sorted(self.paths, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(path) for path in image_paths))
        text = pattern.sub(lambda found: self.paths[found[0]], text)
        # The container's own network namespace has Flower alone on 5555; here it needs a port.
        # So has the console on 8080 (its task sets MAILPIPE_WEB_PORT, which the test overrides).
        text = text.replace("--port=5555", f"--port={self.port}")
        for port in ("5555", "8080"):
            text = text.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{self.port}/")
        return text

    def task_env(self, role: str, secrets: dict[str, str], own: dict[str, str]) -> dict[str, str]:
        container = task_definition(role)
        env = dict(self.env)
        env |= {e["name"]: self.map(e["value"]) for e in container.get("environment", [])}
        wanted = {s["name"] for s in container.get("secrets", [])}
        assert wanted <= set(secrets), f"the test has no value for {wanted - set(secrets)}"
        env |= {name: secrets[name] for name in wanted}
        return env | own

    def start(self, role: str, env: dict[str, str], log_path: Path, *extra: str) -> Role:
        argv = [self.map(token) for token in task_definition(role)["command"]] + list(extra)
        return Role(argv, env, self.workdir, log_path, group=False)

    def health_check(self, role: str) -> list[str]:
        return [self.map(part) for part in task_definition(role)["healthCheck"]["command"]]


@pytest.fixture
def image(tmp_path: Path) -> Image:
    return Image(tmp_path / "container", free_port())


def secrets_of_the_test(database_url: str) -> dict[str, str]:
    return {
        "MAILPIPE_BROKER_URL": REDIS_URL,
        "MAILPIPE_DATABASE_URL": database_url,
        "MAILPIPE_FLOWER_BASIC_AUTH": f"ops:{uuid.uuid4().hex}",
        "MAILPIPE_WEB_OPERATORS": f"ops:{uuid.uuid4().hex}",
        "MAILPIPE_WEB_VIEWERS": f"viewer:{uuid.uuid4().hex}",
        "MAILPIPE_WEB_SECRET": uuid.uuid4().hex,
    }


def own_env(**more: str) -> dict[str, str]:
    return {
        "MAILPIPE_REDIS_PREFIX": own_prefix(),
        # Root here, uid 10001 in the task: Celery's warning about root is not one of the role's
        # log records.
        "PYTHONWARNINGS": ROOT_WARNING,
        # Whatever a role would ask of AWS, never the instance metadata address.
        "AWS_EC2_METADATA_DISABLED": "true",
        **more,
    }


def aws_of_the_test() -> dict[str, str]:
    """What the worker's task role and AWS's endpoints give it, here moto on loopback."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}",
    }


def test_ecs_release_migrates(image, database, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = image.task_env("release", secrets_of_the_test(database.url), own_env())
    release = image.start("release", env, tmp_path / "release.log")
    assert release.process.wait(120) == 0, release.output()
    assert migrated(database.url)
    assert list(image.workdir.iterdir()) == []


def test_ecs_worker_answers_a_ping_logs_json_and_its_health_check_passes(  # type: ignore[no-untyped-def]
    image, migrated_database, tmp_path
) -> None:
    env = image.task_env(
        "worker", secrets_of_the_test(migrated_database.url), own_env() | aws_of_the_test()
    )
    worker = image.start("worker", env, tmp_path / "worker.log")
    check = image.health_check("worker")
    try:
        wait_worker_ready(worker, env, WORKER_NODE)
        assert consumed_queues(env, WORKER_NODE) == queues_of_the_roles(env)["worker"]
        wait_for(lambda: run_health_check(check, env).returncode == 0, 30, "the health check")
        # What each health check costs, run where the worker runs: the broadcast ping of a new
        # interpreter before, the shell test of the file's age now.
        old = [cpu_ms(["/bin/sh", "-c", OLD_WORKER_CHECK], env) for _ in range(5)]
        new = [cpu_ms(["/bin/sh", "-c", check[1]], env) for _ in range(20)]
        assert {code for _, code in old} == {0} and {code for _, code in new} == {0}
        old_ms = statistics.median(ms for ms, _ in old)
        new_ms = statistics.median(ms for ms, _ in new)
        print(
            f"\nworker health check CPU per run: inspect ping {old_ms:.0f} ms, file age {new_ms:.1f} ms"
        )
        assert new_ms * 20 < old_ms
    finally:
        code = worker.stop()
    assert code == 0, worker.output()[-3000:]
    records = json_lines(worker.output())
    assert any(r["message"].endswith(" ready.") for r in records)
    assert "Connected to" in records[0]["message"]  # --quiet: no banner before the first record


def test_ecs_worker_logs_a_failed_job_s_traceback_in_one_json_record(  # type: ignore[no-untyped-def]
    image, res, tmp_path
) -> None:
    """The task's worker, with a module loaded (`-I`) that makes every attempt of a job fail on
    an error nothing foresaw: each attempt's traceback is inside one JSON record, with the task
    and email ids."""
    from mailpipe.cli.ingest import store_emails
    from mailpipe.storage.models import PipelineRun
    from tests.conftest import DATABASE

    def first_attempt_failed() -> bool:
        with res.db.session() as session:
            error = session.scalar(
                select(PipelineRun.error).where(PipelineRun.email_id == email_id)
            )
        return (error or "").startswith("unexpected RuntimeError")

    env = image.task_env(
        "worker",
        secrets_of_the_test(DATABASE.url),
        own_env(PYTHONPATH=str(REPO)) | aws_of_the_test(),
    )
    [email_id] = store_emails(res, [email("bug")])
    worker = image.start("worker", env, tmp_path / "worker.log", "-I", "tests.support.unexpected")
    try:
        wait_worker_ready(worker, env, WORKER_NODE)
        enqueue_in(env, [email_id])
        # The error is retried after the task's own backoff: the first attempt is enough here.
        wait_for(first_attempt_failed, 60, "the first attempt's error on the run")
    finally:
        assert worker.stop() == 0
    records = json_lines(worker.output())
    failure, *retried = [r for r in records if "Traceback" in r.get("exc_info", "")]
    for record in (failure, *retried):
        # The frames and the class, in describe()'s words: not the message, which could quote
        # an email.
        assert record["exc_info"].endswith("\nRuntimeError")
        assert "in _steps_that_raise" in record["exc_info"]
        assert "an error nothing foresaw (email" not in record["exc_info"]
        assert record["email_id"] == email_id and record["task_id"] == failure["task_id"]
        assert record["task_name"] == "mailpipe.process_email"
        assert record["level"] == "ERROR" and record["logger"] == "mailpipe.pipeline.job"
    # The task id is the job's: the worker's main process logged it as received.
    received = f"Task mailpipe.process_email[{failure['task_id']}] received"
    assert received in [r["message"] for r in records]
    # Every record the job's child wrote while it ran carries both ids.
    during = [r for r in records if r.get("task_id") == failure["task_id"]]
    assert len(during) >= 2 and all(r["email_id"] == email_id for r in during)


def test_ecs_worker_and_model_run_an_email_s_two_stages(  # type: ignore[no-untyped-def]
    image, res, tmp_path
) -> None:
    """The two workers' task definitions, with model calls on and the Converse stand-in as
    Bedrock: the worker parses and hands off, the model role (32 threads, the model queue only)
    calls the model and writes the labels. The model role has no blob store: what it reads, the
    CPU stage stored in the database. Its health check passes and it logs JSON lines."""
    from mailpipe.cli.ingest import store_emails
    from tests.conftest import DATABASE, TEST_ENV

    server = BedrockServer().start()
    secrets = secrets_of_the_test(DATABASE.url)
    own = own_env() | aws_of_the_test() | {"AWS_ENDPOINT_URL_BEDROCK_RUNTIME": server.url}
    # The worker's task names the bucket of its environment; here, the test's.
    worker_env = image.task_env(
        "worker", secrets, own | {"MAILPIPE_BLOB_URL": TEST_ENV["MAILPIPE_BLOB_URL"]}
    )
    model_env = image.task_env("model", secrets, own)
    assert "MAILPIPE_BLOB_URL" not in model_env
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    [email_id] = store_emails(res, invoices(1))
    worker = image.start("worker", worker_env, tmp_path / "worker.log")
    model = image.start("model", model_env, tmp_path / "model.log")
    try:
        wait_worker_ready(worker, worker_env, WORKER_NODE)
        wait_worker_ready(model, model_env, MODEL_NODE)
        assert consumed_queues(model_env, MODEL_NODE) == queues_of_the_roles(model_env)["model"]
        stats = inspect(model_env, MODEL_NODE, "stats")
        pool = stats["pool"]
        assert pool["implementation"] == POOLS["model"] and pool["max-concurrency"] == 32
        # One message reserved per thread, so that a live call waits behind no bulk one.
        assert stats["prefetch_count"] == 32
        enqueue_in(worker_env, [email_id])
        assert wait_until_closed(res, [email_id], timeout=60) == {email_id: "succeeded"}
        check = image.health_check("model")
        wait_for(lambda: run_health_check(check, model_env).returncode == 0, 30, "its check")
    finally:
        codes = {"model": model.stop(), "worker": worker.stop()}
        server.stop()
    assert codes == {"model": 0, "worker": 0}, model.output()[-3000:]
    assert len(server.requests) == 1
    with res.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Classification)) == 1
        labels = session.scalars(
            select(EmailLabel.label).where(
                EmailLabel.email_id == email_id, EmailLabel.source == "model"
            )
        ).all()
    assert labels == ["invoice"]
    # Each stage ran on its own role.
    received = {
        role: " ".join(r["message"] for r in json_lines(process.output()))
        for role, process in (("worker", worker), ("model", model))
    }
    assert "Task mailpipe.process_email[" in received["worker"]
    assert "Task mailpipe.classify_email[" not in received["worker"]
    assert "Task mailpipe.classify_email[" in received["model"]
    assert "Task mailpipe.process_email[" not in received["model"]
    # Neither wrote to its working directory: no embedded database, no blob folder.
    assert list(image.workdir.iterdir()) == []


def test_ecs_beat_fires_and_reports_the_fleet_s_metrics(image, migrated_database, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Beat's task definition gives it the broker, the database and the credentials of its task
    role (PutMetricData), what its report needs. It fires the sweep, sends the fleet's metrics
    into the task's namespace, touches its health file and writes only its schedule."""
    secrets = {"MAILPIPE_BROKER_URL": REDIS_URL, "MAILPIPE_DATABASE_URL": migrated_database.url}
    # The task's intervals are 300 s and 60 s; the test does not wait that long.
    own = own_env(MAILPIPE_SWEEP_INTERVAL="2", MAILPIPE_METRICS_INTERVAL="2")
    env = image.task_env("beat", secrets, own | aws_of_the_test())
    started = datetime.now(UTC).replace(microsecond=0)
    beat = image.start("beat", env, tmp_path / "beat.log")
    check = image.health_check("beat")
    try:
        wait_beat_fired(beat, env)
        wait_for(lambda: run_health_check(check, env).returncode == 0, 30, "the health check")
        wait_for(lambda: reported_backlog(started) >= 2, 30, "two reports")
    finally:
        code = beat.stop()
    assert code == 0, beat.output()[-3000:]
    records = json_lines(beat.output())
    assert any("Sending due task sweep" in r["message"] for r in records)
    assert not [r for r in records if r["level"] in ("ERROR", "CRITICAL")]
    # Every report read the database and reached CloudWatch (one may be skipped while the first
    # builds its clients, at a 2 s interval).
    assert not [r for r in records if "could not" in r["message"] or "dropped" in r["message"]]
    assert {p.name for p in image.workdir.iterdir()} <= {
        f"celerybeat-schedule{suffix}" for suffix in ("", ".db", ".dat", ".dir", ".bak")
    }


def reported_backlog(since: datetime) -> float:
    """BacklogPerTask datapoints of the email queue's live lane in the task definition's
    namespace."""
    reply = boto3.client(
        "cloudwatch", endpoint_url=f"http://127.0.0.1:{S3_PORT}"
    ).get_metric_statistics(
        Namespace=task_env_value("beat", "MAILPIPE_METRICS_NAMESPACE"),
        MetricName="BacklogPerTask",
        Dimensions=[{"Name": "Queue", "Value": "mailpipe"}, {"Name": "Lane", "Value": "live"}],
        StartTime=since,
        EndTime=datetime.now(UTC) + timedelta(minutes=1),
        Period=60,
        Statistics=["SampleCount"],
    )
    return sum(p["SampleCount"] for p in reply["Datapoints"])


def task_env_value(role: str, name: str) -> str:
    (value,) = [e["value"] for e in task_definition(role)["environment"] if e["name"] == name]
    return value


def test_ecs_flower_reads_its_config_wherever_it_starts(image, tmp_path) -> None:  # type: ignore[no-untyped-def]
    secrets = secrets_of_the_test("unused")
    env = image.task_env("flower", secrets, own_env())
    user, password = secrets["MAILPIPE_FLOWER_BASIC_AUTH"].split(":")
    flower = image.start("flower", env, tmp_path / "flower.log")
    try:
        wait_flower_ready(flower, image.port, (user, password))
        check = run_health_check(image.health_check("flower"), env)
        assert check.returncode == 0, check.stderr
    finally:
        code = flower.stop()
    assert code == 0, flower.output()[-3000:]
    json_lines(flower.output())


def test_ecs_web_asks_for_its_users_passes_its_health_check_and_runs_the_cli(  # type: ignore[no-untyped-def]
    image, migrated_database, tmp_path
) -> None:
    """The console's task definition: on every interface, its users and CSRF key from the task's
    secrets. /healthz answers without credentials, and the task's health check passes; every other
    page asks for a user; a viewer reads the API. `mailpipe failed`, as ECS Exec runs it in the
    task, works with the task's settings. The port is the test's own (8080 in the task)."""
    secrets = secrets_of_the_test(migrated_database.url)
    env = image.task_env("web", secrets, own_env(MAILPIPE_WEB_PORT=str(image.port)))
    viewer = tuple(secrets["MAILPIPE_WEB_VIEWERS"].split(":"))
    operator = tuple(secrets["MAILPIPE_WEB_OPERATORS"].split(":"))
    url = f"http://127.0.0.1:{image.port}"
    web = image.start("web", env, tmp_path / "web.log")
    try:
        wait_for(alive_and(web, answering(f"{url}/healthz")), 60, "the console to answer /healthz")
        check = run_health_check(image.health_check("web"), env)
        assert check.returncode == 0, check.stderr
        assert requests.get(f"{url}/", timeout=5).status_code == 401
        assert (
            requests.get(f"{url}/failed", auth=(operator[0], "wrong"), timeout=5).status_code == 401
        )
        assert requests.get(f"{url}/failed", auth=operator, timeout=10).status_code == 200
        queues = requests.get(f"{url}/api/queues", auth=viewer, timeout=10)
        assert queues.status_code == 200, queues.text
        assert queues.json()["queues"]["model"]["name"] == "mailpipe.model"
        cli = subprocess.run(
            [image.map(token) for token in ["mailpipe", "failed", "--json"]],
            env=env,
            cwd=image.workdir,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
    finally:
        code = web.stop()
    # uvicorn ends its graceful shutdown by raising the signal it got again.
    assert code == -signal.SIGTERM, web.output()[-3000:]
    assert "Application shutdown complete." in [r["message"] for r in json_lines(web.output())]
    # A health check that fails: nothing answers on the port once the task has stopped.
    assert run_health_check(image.health_check("web"), env).returncode != 0
