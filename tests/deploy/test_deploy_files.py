"""The deploy files are well formed and keep the promises the app relies on.

Offline checks only: task definitions against botocore's own ECS model, the template through
cfn-lint, IAM documents by inspection, the Dockerfile by parsing. No AWS call, no Docker engine.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import botocore.session
import pytest
from botocore.validate import ParamValidator
from cfnlint.decode import decode

from mailpipe.broker.queues import (
    Lane,
    Stage,
    control_queue,
    job_queues,
    model_queue,
    stage_queue,
)
from mailpipe.operations.metrics import JOB_COUNT_NAMES, BacklogMetrics, stage_jobs
from mailpipe.operations.sinks import metric_data
from mailpipe.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TEMPLATE = DEPLOY / "cloudformation" / "mailpipe.yaml"
ROLES = ("worker", "model", "beat", "flower", "web", "release")
# long-running; release is a one-off run-task
SERVICES = ("worker", "model", "beat", "flower", "web")
WORKERS = ("worker", "model")  # Celery workers: the CPU stage and the model stage
# Roles that call AWS APIs: S3 (worker), Bedrock (model), PutMetricData (beat), and the roles
# whose tasks run ECS Exec's agent (beat, web).
WITH_TASK_ROLE = ("worker", "model", "beat", "web")
WITH_EXEC = ("beat", "web")
# ECS Exec's agent writes its state and logs here; with a read-only root they must be volumes.
EXEC_AGENT_PATHS = {"/var/lib/amazon", "/var/log/amazon"}
EXEC_ACTIONS = {
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
}
ACCOUNT = "123456789012"

# Fargate's allowed task sizes: cpu units -> memory MiB.
FARGATE_SIZES = {
    256: {512, 1024, 2048},
    512: set(range(1024, 4097, 1024)),
    1024: set(range(2048, 8193, 1024)),
    2048: set(range(4096, 16385, 1024)),
    4096: set(range(8192, 30721, 1024)),
}
SECRET_NAME = re.compile(
    r"PASSWORD|SECRET|TOKEN|BASIC_AUTH|API_KEY|ACCESS_KEY|CREDENTIAL", re.IGNORECASE
)
# Actions AWS only authorises on Resource "*"; each must be narrowed some other way if it can be.
STAR_RESOURCE_ACTIONS = {
    "cloudwatch:PutMetricData": "cloudwatch:namespace",  # narrowed by this condition key
    "ecr:GetAuthorizationToken": None,  # a token for the registry, no resource type exists
} | dict.fromkeys(EXEC_ACTIONS)  # ECS Exec's channels: no resource type either


def load_task_definition(role: str) -> dict:
    return json.loads((DEPLOY / "ecs" / f"{role}.json").read_text())


def container(role: str) -> dict:
    (only,) = load_task_definition(role)["containerDefinitions"]
    return only


def env(role: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(role).get("environment", [])}


def secrets(role: str) -> dict[str, str]:
    return {s["name"]: s["valueFrom"] for s in container(role).get("secrets", [])}


def iam_document(name: str) -> dict:
    return json.loads((DEPLOY / "iam" / f"{name}.json").read_text())


def as_list(value) -> list:
    return value if isinstance(value, list) else [value]


@pytest.fixture(scope="module")
def template() -> dict:
    tpl, matches = decode(str(TEMPLATE))
    assert not matches, matches
    return tpl


# --- ECS task definitions ----------------------------------------------------------------------


def test_every_role_has_a_task_definition():
    assert sorted(p.stem for p in (DEPLOY / "ecs").glob("*.json")) == sorted(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_task_definition_is_valid_register_task_definition_input(role):
    shape = (
        botocore.session.get_session()
        .get_service_model("ecs")
        .operation_model("RegisterTaskDefinition")
        .input_shape
    )
    report = ParamValidator().validate(load_task_definition(role), shape)
    assert not report.has_errors(), report.generate_report()


def test_param_validator_rejects_a_broken_task_definition():
    """Guards the check above: the validator does see wrong types, unknown and missing fields."""
    shape = (
        botocore.session.get_session()
        .get_service_model("ecs")
        .operation_model("RegisterTaskDefinition")
        .input_shape
    )
    broken = load_task_definition("worker")
    broken["containerDefinitions"][0]["stopTimeout"] = "120"
    broken["containerDefinitions"][0]["stopTimeOut"] = 120
    del broken["family"]
    report = ParamValidator().validate(broken, shape).generate_report()
    assert "stopTimeout" in report and "stopTimeOut" in report and "family" in report


@pytest.mark.parametrize("role", ROLES)
def test_task_definition_runs_on_fargate(role):
    td = load_task_definition(role)
    assert td["requiresCompatibilities"] == ["FARGATE"]
    assert td["networkMode"] == "awsvpc"
    assert int(td["memory"]) in FARGATE_SIZES[int(td["cpu"])]
    assert container(role)["essential"] is True


@pytest.mark.parametrize("role", ROLES)
def test_container_runs_as_the_image_user_with_a_read_only_root(role):
    c = container(role)
    uid = c["user"].split(":")[0]
    assert uid not in ("0", "root")
    assert c["readonlyRootFilesystem"] is True
    # Every writable path is a task volume declared as VOLUME in the Dockerfile, which gives it the
    # image's ownership on Fargate.
    volumes = {v["name"] for v in load_task_definition(role)["volumes"]}
    mounts = {m["containerPath"] for m in c["mountPoints"]}
    assert {m["sourceVolume"] for m in c["mountPoints"]} <= volumes
    exec_agent = EXEC_AGENT_PATHS if role in WITH_EXEC else set()
    assert mounts <= set(dockerfile_volumes()) | exec_agent
    assert exec_agent <= mounts


@pytest.mark.parametrize("role", ROLES)
def test_container_drops_every_linux_capability(role):
    # None of the roles needs one: they run as uid 10001, bind no port below 1024, and tini only
    # forwards signals to its own children.
    assert container(role)["linuxParameters"]["capabilities"] == {"drop": ["ALL"]}


@pytest.mark.parametrize("role", ROLES)
def test_logs_go_to_awslogs_in_the_stack_log_group(role, template):
    log = container(role)["logConfiguration"]
    assert log["logDriver"] == "awslogs"
    group = template["Resources"]["LogGroup"]["Properties"]["LogGroupName"]["Fn::Sub"]
    assert log["options"]["awslogs-group"] == group.replace("${NamePrefix}", "mailpipe")
    assert log["options"]["awslogs-stream-prefix"] == role
    assert log["options"]["awslogs-region"]


@pytest.mark.parametrize("role", ROLES)
def test_command_is_the_role_and_keeps_the_image_entrypoint(role):
    c = container(role)
    expected = {
        # --quiet: no startup banner, so every line the role writes is a JSON log record.
        "worker": [
            "celery",
            "-A",
            "mailpipe",
            "--quiet",
            "worker",
            "--queues=mailpipe,mailpipe.bulk,mailpipe.control",
            "--loglevel=INFO",
        ],
        "model": [
            "celery",
            "-A",
            "mailpipe",
            "--quiet",
            "worker",
            "--pool=threads",
            "--concurrency=32",
            "--queues=mailpipe.model,mailpipe.model.bulk",
            "--hostname=model@%h",
            "--loglevel=INFO",
        ],
        "beat": ["celery", "-A", "mailpipe", "--quiet", "beat", "--loglevel=INFO"],
        "flower": [
            "celery",
            "-A",
            "mailpipe",
            "flower",
            "--conf=/etc/mailpipe/flowerconfig.py",
            "--port=5555",
        ],
        "web": ["mailpipe", "web"],
        "release": ["mailpipe", "db", "upgrade"],
    }[role]
    assert c["command"] == expected
    assert "entryPoint" not in c, "tini stays PID 1 only through the image's ENTRYPOINT"


def _role_arguments(command: list[str]) -> list[str]:
    """The arguments after the role's subcommand (worker, beat, flower)."""
    for i, token in enumerate(command):
        if token in ("worker", "beat", "flower"):
            return command[i + 1 :]
    return []


def option(command: list[str], name: str) -> str | None:
    """The value of `--<name>=value` in `command`; None when the option is not given."""
    values = [t.split("=", 1)[1] for t in command if t.startswith(f"--{name}=")]
    assert len(values) <= 1, (name, command)
    return values[0] if values else None


def procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if line.strip())


def all_commands() -> dict[str, list[str]]:
    commands = {f"ecs:{role}": container(role)["command"] for role in ROLES}
    commands |= {f"procfile:{role}": shlex.split(line) for role, line in procfile().items()}
    return commands


@pytest.mark.parametrize("where", sorted(all_commands()))
def test_options_take_their_value_after_an_equals_sign(where):
    """Flower 2.x keeps only the arguments that look like options: `--port 5555` loses its value
    and Flower stops with "Option 'port' requires a value". One rule for every command."""
    arguments = _role_arguments(all_commands()[where])
    for option, following in itertools.pairwise([*arguments, None]):
        if option.startswith("--") and "=" not in option:
            assert following is None or following.startswith("-"), (where, option, following)


def test_the_procfile_has_every_role():
    assert set(procfile()) == set(ROLES)
    # The model role on threads, with the connections they share, as its task definition has it.
    model = shlex.split(procfile()["model"])
    assert option(model, "pool") == "threads"
    assert option(model, "concurrency") == option(container("model")["command"], "concurrency")
    assert "MAILPIPE_DB_POOL_SIZE=8" in model
    # Both workers may run on one machine, and Flower and `celery inspect` tell workers apart by
    # node name (celery@<host> unless --hostname= says otherwise).
    names = {role: option(shlex.split(procfile()[role]), "hostname") for role in WORKERS}
    assert names == {"worker": None, "model": "model@%h"}
    # The Procfile is the local set-up: Flower on loopback, its config named explicitly (a
    # missing ./flowerconfig.py is then an error, not a Flower without its checks).
    flower = shlex.split(procfile()["flower"])
    assert "--address=127.0.0.1" in flower
    assert "--conf=./flowerconfig.py" in flower


def consumed(where: str, queue: str | None = None) -> list[str]:
    """The queues the command's `--queues=` names, as `sh` expands it with MAILPIPE_QUEUE=`queue`
    (unset for None); an exec-form command has nothing to expand."""
    value = option(all_commands()[where], "queues")
    assert value is not None, f"{where} names no queues, so it would consume every one"
    env = {"PATH": os.environ["PATH"]} | ({"MAILPIPE_QUEUE": queue} if queue else {})
    expanded = subprocess.run(
        ["sh", "-c", f"printf %s {value}"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return expanded.split(",")


def queues_of_the_roles(queue: str) -> dict[str, set[str]]:
    settings = Settings.model_construct(queue=queue)
    return {
        "worker": {stage_queue(Stage.CPU, settings, lane) for lane in Lane}
        | {control_queue(settings)},
        "model": {stage_queue(Stage.MODEL, settings, lane) for lane in Lane},
    }


@pytest.mark.parametrize("queue", [None, "acme"])
def test_the_procfile_workers_consume_the_queues_derived_from_mailpipe_queue(queue):
    """The Procfile names the queues through ${MAILPIPE_QUEUE:-mailpipe}, as the app derives them
    (mailpipe/broker/queues.py): the CPU stage and the sweeps on the worker, the model stage
    on the model role, every job queue consumed by exactly one of them."""
    name = queue or Settings.model_fields["queue"].default
    expected = queues_of_the_roles(name)
    for role in WORKERS:
        names = consumed(f"procfile:{role}", queue)
        assert len(names) == len(set(names)) and set(names) == expected[role], role
    settings = Settings.model_construct(queue=name)
    assert set(job_queues(settings)) | {control_queue(settings)} == set().union(*expected.values())
    assert not set.intersection(*expected.values())


def test_the_task_definitions_consume_the_default_queues():
    """Exec form has no shell: the task definitions name the queues of the default
    MAILPIPE_QUEUE, which their environment leaves as it is."""
    expected = queues_of_the_roles(Settings.model_fields["queue"].default)
    for role in WORKERS:
        assert "MAILPIPE_QUEUE" not in env(role)
        assert set(consumed(f"ecs:{role}")) == expected[role], role


@pytest.mark.parametrize("role", SERVICES)
def test_long_running_roles_have_a_health_check(role):
    check = container(role)["healthCheck"]
    assert check["command"][0] in ("CMD", "CMD-SHELL") and len(check["command"]) >= 2
    assert check["timeout"] < check["interval"]
    assert check["retries"] >= 2


# The setting naming each role's health file; the model role is a worker, with a file of its own.
HEALTH_FILES = {
    "worker": "MAILPIPE_WORKER_HEALTH_FILE",
    "model": "MAILPIPE_WORKER_HEALTH_FILE",
    "beat": "MAILPIPE_BEAT_HEALTH_FILE",
}


@pytest.mark.parametrize("role", sorted(HEALTH_FILES))
def test_worker_model_and_beat_health_checks_test_the_age_of_their_health_file(role):
    """No interpreter, no broadcast: sh and find, on the file the role touches (a worker's
    heartbeat thread every 10 s, beat's scheduler every tick, at most 20 s apart)."""
    kind, command = container(role)["healthCheck"]["command"]
    path = env(role)[HEALTH_FILES[role]]
    assert kind == "CMD-SHELL"
    assert command == f'test -n "$(find {path} -mmin -1)"'
    # On a task volume (the root filesystem is read-only), named for its role.
    assert path == f"/tmp/mailpipe-{role}.health" and "/tmp" in dockerfile_volumes()
    assert HEALTH_FILES[role].removeprefix("MAILPIPE_").lower() in Settings.model_fields
    # Touched at least twice within the minute the check allows.
    defaults = Settings.model_fields
    touched_every = {
        "worker": float(defaults["worker_heartbeat_interval"].default),
        "model": float(defaults["worker_heartbeat_interval"].default),
        "beat": defaults["beat_lock_timeout"].default / 3,
    }[role]
    assert touched_every <= 30


def test_the_health_file_settings_default_to_the_worker_s_and_beat_s_files():
    """Outside ECS (the Procfile) the defaults apply; in ECS every role names its file."""
    defaults = Settings.model_fields
    assert str(defaults["worker_health_file"].default) == env("worker")[HEALTH_FILES["worker"]]
    assert str(defaults["beat_health_file"].default) == env("beat")[HEALTH_FILES["beat"]]


def test_flower_health_check_uses_the_unauthenticated_endpoint_with_curl():
    command = container("flower")["healthCheck"]["command"]
    assert command[:2] == ["CMD", "curl"]
    assert "--fail" in command and command[-1] == "http://127.0.0.1:5555/healthcheck"
    max_time = float(command[command.index("--max-time") + 1])
    assert max_time < container("flower")["healthCheck"]["timeout"]
    assert container("flower")["portMappings"][0]["containerPort"] == 5555
    # curl is installed in the image's final stage.
    installs = " ".join(v for k, v in final_stage() if k == "RUN" and "apt-get install" in v)
    assert re.search(r"\bcurl\b", installs)


def test_web_health_check_asks_the_open_healthz_with_curl():
    """The image has curl (Flower's check), so the console's check starts no interpreter."""
    command = container("web")["healthCheck"]["command"]
    port = int(env("web")["MAILPIPE_WEB_PORT"])
    assert command[:2] == ["CMD", "curl"]
    assert "--fail" in command and command[-1] == f"http://127.0.0.1:{port}/healthz"
    max_time = float(command[command.index("--max-time") + 1])
    assert max_time < container("web")["healthCheck"]["timeout"]
    assert [p["containerPort"] for p in container("web")["portMappings"]] == [port]
    # Every interface of the task's own network namespace: the load balancer's and the check's.
    assert env("web")["MAILPIPE_WEB_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("role", ROLES)
def test_every_role_logs_json_lines_and_awslogs_starts_an_event_at_each(role):
    assert env(role)["MAILPIPE_LOG_FORMAT"] == "json"
    pattern = container(role)["logConfiguration"]["options"]["awslogs-multiline-pattern"]
    record = '{"level": "ERROR", "message": "x", "exc_info": "Traceback (most recent call last):"}'
    assert re.match(pattern, record)
    # A line that is not a record (a crash before logging was set up) joins the event before it.
    for stray in ("Traceback (most recent call last):", '  File "x.py", line 1', "KeyError: 1"):
        assert not re.match(pattern, stray)


def test_flower_config_path_is_fixed_in_the_image():
    env_lines = " ".join(v for k, v in final_stage() if k == "ENV")
    copied = [v.split() for k, v in final_stage() if k == "COPY" and "--from" not in v]
    assert ["mailpipe/app/flowerconfig.py", "/etc/mailpipe/flowerconfig.py"] in copied
    assert "FLOWER_CONF=/etc/mailpipe/flowerconfig.py" in env_lines
    assert "--conf=/etc/mailpipe/flowerconfig.py" in container("flower")["command"]


@pytest.mark.parametrize("role", WORKERS)
def test_workers_stop_through_celery_soft_shutdown(role):
    c = container(role)
    assert c["stopTimeout"] == 120
    assert env(role)["REMAP_SIGTERM"] == "SIGQUIT"
    soft = float(
        env(role).get(
            "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT", Settings.model_fields["soft_shutdown_timeout"].default
        )
    )
    assert soft == 90
    # Celery still has to requeue the unfinished jobs and exit after the soft window, before ECS
    # sends SIGKILL at stopTimeout.
    assert soft + 10 <= c["stopTimeout"]


def task_settings(role: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the role's task runs with: its environment over the app's defaults."""
    # Only the task definition and the app defaults count, not the test suite's short timeouts.
    for name in [n for n in os.environ if n.startswith("MAILPIPE_")]:
        monkeypatch.delenv(name)
    values = {
        k.removeprefix("MAILPIPE_").lower(): v
        for k, v in env(role).items()
        if k.startswith("MAILPIPE_")
    }
    return Settings(**values)  # raises when a rule of the settings is broken


def test_worker_settings_pass_the_app_time_budget_check(monkeypatch):
    settings = task_settings("worker", monkeypatch)
    assert settings.worker_concurrency == 2
    assert settings.metrics_namespace is None  # beat reports the fleet's metrics
    assert settings.blob_url.startswith("s3://")
    # The CPU stage must know that the model is remote, to hand the email off to the model role.
    assert settings.model_backend == "bedrock"


def test_model_settings_are_sized_for_threads(monkeypatch):
    settings = task_settings("model", monkeypatch)
    assert settings.model_backend == "bedrock"
    assert settings.metrics_namespace is None  # beat reports the fleet's metrics
    # Threads hold a connection only for their short transactions: a few serve all 32.
    assert option(container("model")["command"], "concurrency") == "32"
    assert settings.db_pool_size == 8
    # The model stage reads what the CPU stage stored in the database, never a blob; its
    # bulk lane waits for the model batches that beat's leader writes and reads.
    assert "MAILPIPE_BLOB_URL" not in env("model")
    assert settings.model_batch_on
    # Both workers call the same model in the same region.
    for name in ("MAILPIPE_BEDROCK_MODEL_ID", "MAILPIPE_BEDROCK_REGION"):
        assert env("model")[name] == env("worker")[name]


def test_every_broker_client_uses_the_same_visibility_timeout():
    timeouts = {
        role: env(role).get("MAILPIPE_VISIBILITY_TIMEOUT")
        for role in ROLES
        if "MAILPIPE_BROKER_URL" in secrets(role)
    }
    assert set(timeouts) == {"worker", "model", "beat", "flower", "web"}
    assert set(timeouts.values()) == {"1800"}, timeouts


@pytest.mark.parametrize("role", ROLES)
def test_no_literal_secret_in_the_environment(role):
    for name, value in env(role).items():
        assert not SECRET_NAME.search(name), name
        assert not (name.endswith("_URL") and "@" in value), name
        assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", value), name
    for required in (
        "MAILPIPE_DATABASE_URL",
        "MAILPIPE_BROKER_URL",
        "MAILPIPE_FLOWER_BASIC_AUTH",
        "MAILPIPE_WEB_OPERATORS",
        "MAILPIPE_WEB_VIEWERS",
        "MAILPIPE_WEB_SECRET",
    ):
        assert required not in env(role)


@pytest.mark.parametrize("role", ROLES)
def test_every_secret_comes_from_secrets_manager_or_ssm(role):
    entries = container(role).get("secrets", [])
    assert entries
    for entry in entries:
        assert set(entry) == {"name", "valueFrom"}
        assert re.match(
            rf"^arn:aws:(secretsmanager:[a-z0-9-]+:{ACCOUNT}:secret:.+-[A-Za-z0-9]{{6}}"
            rf"|ssm:[a-z0-9-]+:{ACCOUNT}:parameter/.+)$",
            entry["valueFrom"],
        ), entry


def test_roles_get_only_the_secrets_they_use():
    assert set(secrets("worker")) == {"MAILPIPE_DATABASE_URL", "MAILPIPE_BROKER_URL"}
    assert set(secrets("model")) == {"MAILPIPE_DATABASE_URL", "MAILPIPE_BROKER_URL"}
    # Beat's report counts the failed runs in the database.
    assert set(secrets("beat")) == {"MAILPIPE_DATABASE_URL", "MAILPIPE_BROKER_URL"}
    assert set(secrets("flower")) == {"MAILPIPE_BROKER_URL", "MAILPIPE_FLOWER_BASIC_AUTH"}
    # The console reads and acts on runs (database), queues and enqueues (broker), and holds its
    # users and its CSRF key.
    assert set(secrets("web")) == {
        "MAILPIPE_DATABASE_URL",
        "MAILPIPE_BROKER_URL",
        "MAILPIPE_WEB_OPERATORS",
        "MAILPIPE_WEB_VIEWERS",
        "MAILPIPE_WEB_SECRET",
    }
    # `mailpipe db upgrade` opens no Redis connection (tests/integration/test_roles.py runs it
    # with the database alone).
    assert set(secrets("release")) == {"MAILPIPE_DATABASE_URL"}
    # One secret per setting across roles.
    for name in ("MAILPIPE_DATABASE_URL", "MAILPIPE_BROKER_URL"):
        assert len({secrets(r)[name] for r in ROLES if name in secrets(r)}) == 1


@pytest.mark.parametrize("role", ROLES)
def test_execution_role_may_read_exactly_the_task_secrets(role):
    statements = iam_document(f"{role}-execution-policy")["Statement"]
    readable = {
        resource
        for s in statements
        if set(as_list(s["Action"])) & {"secretsmanager:GetSecretValue", "ssm:GetParameters"}
        for resource in as_list(s["Resource"])
    }
    assert readable == set(secrets(role).values())


@pytest.mark.parametrize("role", ROLES)
def test_task_definition_roles_are_the_stack_roles(role, template):
    td = load_task_definition(role)
    stack_roles = {
        res["Properties"]["RoleName"]["Fn::Sub"].replace("${NamePrefix}", "mailpipe")
        for res in template["Resources"].values()
        if res["Type"] == "AWS::IAM::Role"
    }
    execution = td["executionRoleArn"].removeprefix(f"arn:aws:iam::{ACCOUNT}:role/")
    assert execution == f"mailpipe-{role}-execution" and execution in stack_roles
    if role in WITH_TASK_ROLE:
        task = td["taskRoleArn"].removeprefix(f"arn:aws:iam::{ACCOUNT}:role/")
        assert task == f"mailpipe-{role}-task" and task in stack_roles
    else:
        assert "taskRoleArn" not in td, "no AWS API calls, so no credentials"


def test_only_beat_sends_metrics(monkeypatch):
    """The fleet's report runs in the beat holding the lock, from its own process. So only beat
    has the namespace, and only its task role may put metrics."""
    senders = {role for role in ROLES if "MAILPIPE_METRICS_NAMESPACE" in env(role)}
    assert senders == {"beat"}
    assert task_settings("beat", monkeypatch).metrics_namespace == "Mailpipe"
    putters = {
        path.stem
        for path in (DEPLOY / "iam").glob("*-task-policy.json")
        if any(s["Sid"] == "PutMetrics" for s in iam_document(path.stem)["Statement"])
    }
    assert putters == {"beat-task-policy"}


# --- Dockerfile --------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def dockerfile_volumes() -> list[str]:
    return [p for k, v in final_stage() if k == "VOLUME" for p in json.loads(v)]


def test_dockerfile_uses_slim_python_311():
    args = dict(v.split("=", 1) for k, v in dockerfile_instructions() if k == "ARG" and "=" in v)
    bases = [v.split()[0] for k, v in dockerfile_instructions() if k == "FROM"]
    resolved = {args.get(b.strip("${}"), b) for b in bases}
    base = r"python:3\.11-slim(-\w+)?(@sha256:[0-9a-f]{64})?"  # a tag, pinned by digest or not
    assert resolved and all(re.fullmatch(base, b) for b in resolved)


def test_dockerfile_runs_as_a_non_root_user():
    users = [v for k, v in final_stage() if k == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid not in ("root", "0")
    assert container("worker")["user"] == users[-1]


def test_dockerfile_entrypoint_is_tini_in_exec_form():
    (entrypoint,) = [v for k, v in final_stage() if k == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["tini", "--"]
    (cmd,) = [v for k, v in final_stage() if k == "CMD"]
    assert json.loads(cmd) == container("worker")["command"]


def test_dockerfile_holds_no_secret():
    for keyword, value in dockerfile_instructions():
        if keyword in ("ENV", "ARG"):
            assert not SECRET_NAME.search(value), value
            assert "MAILPIPE_DATABASE_URL" not in value and "MAILPIPE_BROKER_URL" not in value
    copied = " ".join(v for k, v in dockerfile_instructions() if k in ("COPY", "ADD"))
    assert ".env" not in copied


def test_dockerfile_installs_the_package_from_the_repository():
    copied = [v for k, v in dockerfile_instructions() if k == "COPY" and "--from" not in v]
    sources = {src for v in copied for src in v.split()[:-1]}
    for needed in ("pyproject.toml", "requirements.lock", "mailpipe"):
        assert needed in sources
    # Dependencies are installed from the lock file, with hashes, before the source is copied,
    # so code changes reuse that layer.
    instructions = dockerfile_instructions()
    first_source = next(
        i for i, (k, v) in enumerate(instructions) if k == "COPY" and "mailpipe" in v.split()
    )
    deps = next(
        i
        for i, (k, v) in enumerate(instructions)
        if k == "RUN" and "--require-hashes" in v and "requirements.lock" in v
    )
    assert deps < first_source


def test_dockerignore_applies_to_the_documented_build():
    # `docker build -f deploy/Dockerfile .` reads deploy/Dockerfile.dockerignore; a file named
    # deploy/.dockerignore would not apply to that build context.
    patterns = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert patterns[patterns.index("*") + 1 :].count("!mailpipe/") == 1
    assert "!pyproject.toml" in patterns and "!requirements.lock" in patterns


# --- CloudFormation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfn_lint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """cfn-lint's findings for the template and for a broken copy of it, by file name, from one
    run: cfn-lint takes seconds to load its rules."""
    broken = tmp_path_factory.mktemp("cfn") / "broken.yaml"
    text = TEMPLATE.read_text().replace(
        "ScalableDimension: ecs:service:DesiredCount", "ScalableDimension: ecs:service:Desired"
    )
    broken.write_text(text.replace("Statistic: Maximum", "Statistic: Largest"))
    exe = Path(sys.executable).parent / "cfn-lint"
    proc = subprocess.run(
        [str(exe), "--format", "json", "--", str(TEMPLATE), str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 2, 4, 6, 8, 10, 12, 14), proc.stderr
    findings = json.loads(proc.stdout or "[]")
    by_file = {
        name: [f for f in findings if f["Filename"] == str(path)]
        for name, path in (("template", TEMPLATE), ("broken", broken))
    }
    assert sum(map(len, by_file.values())) == len(findings), findings
    return by_file


def test_template_passes_cfn_lint(cfn_lint):
    problems = [f for f in cfn_lint["template"] if f["Level"] in ("Error", "Warning")]
    assert not problems, json.dumps(problems, indent=1)


def test_cfn_lint_catches_a_broken_template(cfn_lint):
    assert [f for f in cfn_lint["broken"] if f["Level"] == "Error"]


def lanes_summed(metric: dict) -> str:
    """The queue whose lanes' BacklogPerTask a target tracking metric sums: one expression
    returned, over one Average of each lane's, each a metric the report sends."""
    assert set(metric) == {"Metrics"}
    [returned] = [query for query in metric["Metrics"] if query.get("ReturnData", True)]
    summed = {
        query["Id"]: query["MetricStat"] for query in metric["Metrics"] if query is not returned
    }
    assert sorted(returned["Expression"].replace(" ", "").split("+")) == sorted(summed)
    queues = set()
    lanes = []
    for stat in summed.values():
        assert stat["Stat"] == "Average"
        assert stat["Metric"]["MetricName"] == "BacklogPerTask"
        assert stat["Metric"]["Namespace"] == {"Ref": "MetricsNamespace"}
        dimensions = {d["Name"]: resolved(d["Value"]) for d in stat["Metric"]["Dimensions"]}
        assert ("BacklogPerTask", frozenset(dimensions.items())) in emitted_metrics()
        queues.add(dimensions["Queue"])
        lanes.append(dimensions["Lane"])
    assert sorted(lanes) == sorted(Lane)
    [queue] = queues
    return queue


def test_worker_scales_on_backlog_per_task(template):
    res = template["Resources"]
    target = res["WorkerScalableTarget"]["Properties"]
    assert target["ScalableDimension"] == "ecs:service:DesiredCount"
    assert target["ResourceId"] == {"Fn::Sub": "service/${ClusterName}/${WorkerService.Name}"}
    params = template["Parameters"]
    assert params["WorkerMinTasks"]["MinValue"] >= 1  # the sweeps need a running worker
    config = res["WorkerBacklogScalingPolicy"]["Properties"][
        "TargetTrackingScalingPolicyConfiguration"
    ]
    assert res["WorkerBacklogScalingPolicy"]["Properties"]["PolicyType"] == "TargetTrackingScaling"
    assert lanes_summed(config["CustomizedMetricSpecification"]) == QUEUE
    assert params["MetricsNamespace"]["Default"] == "Mailpipe"
    assert params["QueueName"]["Default"] == "mailpipe"
    assert config["TargetValue"] == {"Ref": "BacklogPerTaskTarget"}
    # The default target is acceptable wait (60 s) x concurrency / mean job time (0.026 s).
    assert params["BacklogPerTaskTarget"]["Default"] == round(60 * 2 / 0.026)
    assert config["ScaleOutCooldown"] == {"Ref": "ScaleOutCooldownSeconds"}
    assert config["ScaleInCooldown"] == {"Ref": "ScaleInCooldownSeconds"}
    assert config["DisableScaleIn"] is False


def test_model_service_scales_on_the_backlog_per_task_of_the_model_queue(template):
    res = template["Resources"]
    params = template["Parameters"]
    target = res["ModelScalableTarget"]["Properties"]
    assert target["ScalableDimension"] == "ecs:service:DesiredCount"
    assert target["ResourceId"] == {"Fn::Sub": "service/${ClusterName}/${ModelService.Name}"}
    assert target["MinCapacity"] == {"Ref": "ModelMinTasks"}
    assert target["MaxCapacity"] == {"Ref": "ModelMaxTasks"}
    assert 1 <= params["ModelMinTasks"]["Default"] <= params["ModelMaxTasks"]["Default"]
    # Its own policy on its own target: the worker's policies never move the model service.
    policies = {
        name: r["Properties"]
        for name, r in res.items()
        if r["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"
        and r["Properties"]["ScalingTargetId"] == {"Ref": "ModelScalableTarget"}
    }
    assert list(policies) == ["ModelBacklogScalingPolicy", "ModelLiveJobAgeScalingPolicy"]
    policy = policies["ModelBacklogScalingPolicy"]
    assert policy["PolicyType"] == "TargetTrackingScaling"
    config = policy["TargetTrackingScalingPolicyConfiguration"]
    queue = params["QueueName"]["Default"]
    assert lanes_summed(config["CustomizedMetricSpecification"]) == model_queue(
        Settings.model_construct(queue=queue)
    )
    assert config["TargetValue"] == {"Ref": "ModelBacklogPerTaskTarget"}
    assert config["DisableScaleIn"] is False
    # The default target is threads per task x acceptable wait (60 s) / mean call time (2 s).
    assert params["ModelBacklogPerTaskTarget"]["Default"] == 32 * 60 / 2


def test_services(template):
    res = template["Resources"]
    worker = res["WorkerService"]["Properties"]
    assert "DesiredCount" not in worker, "auto scaling owns the worker count"
    assert "DesiredCount" not in res["ModelService"]["Properties"], "and the model count"
    assert res["BeatService"]["Properties"]["DesiredCount"] == 1
    assert res["FlowerService"]["Properties"]["DesiredCount"] == 1
    assert res["WebService"]["Properties"]["DesiredCount"] >= 1
    assert res["ModelService"]["Properties"]["TaskDefinition"] == {"Ref": "ModelTaskDefinitionArn"}
    assert res["WebService"]["Properties"]["TaskDefinition"] == {"Ref": "WebTaskDefinitionArn"}
    for name in ("WorkerService", "ModelService", "BeatService", "FlowerService", "WebService"):
        props = res[name]["Properties"]
        assert props["LaunchType"] == "FARGATE"
        assert props["NetworkConfiguration"]["AwsvpcConfiguration"]["AssignPublicIp"] == "DISABLED"
        assert props["DeploymentConfiguration"]["DeploymentCircuitBreaker"]["Enable"] is True
    assert "ClusterName" in template["Parameters"]


def services_by_role(template: dict) -> dict[str, dict]:
    """The ECS services' properties, by the role their tag names."""
    return {
        tag["Value"]: r["Properties"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::ECS::Service"
        for tag in r["Properties"]["Tags"]
        if tag["Key"] == "role"
    }


def test_the_console_stays_up_through_a_deployment(template):
    """The new web task starts, and is healthy, before the old one stops."""
    deployment = services_by_role(template)["web"]["DeploymentConfiguration"]
    desired = services_by_role(template)["web"]["DesiredCount"]
    assert deployment["MinimumHealthyPercent"] >= 100
    assert desired * deployment["MaximumPercent"] // 100 > desired


def test_the_console_is_reachable_on_its_port_from_the_given_group_only(template):
    web = services_by_role(template)["web"]
    (group,) = web["NetworkConfiguration"]["AwsvpcConfiguration"]["SecurityGroups"]
    (ingress,) = template["Resources"][group["Ref"]]["Properties"]["SecurityGroupIngress"]
    port = int(env("web")["MAILPIPE_WEB_PORT"])
    assert (ingress["FromPort"], ingress["ToPort"]) == (port, port)
    assert ingress["SourceSecurityGroupId"] == {"Ref": "WebIngressSecurityGroupId"}
    balanced = web["LoadBalancers"]["Fn::If"][1]
    assert balanced == [
        {
            "ContainerName": "web",
            "ContainerPort": port,
            "TargetGroupArn": {"Ref": "WebTargetGroupArn"},
        }
    ]


def test_ecs_exec_is_on_for_web_and_beat_only_and_their_task_roles_may_open_its_channels(template):
    """`aws ecs execute-command` runs the CLI on the web task (or beat's): the service must allow
    it and the task role must let the agent open its channels; no other role gets either."""
    services = services_by_role(template)
    assert {role for role, props in services.items() if props.get("EnableExecuteCommand")} == set(
        WITH_EXEC
    )
    granted = _actions_by_policy(template)
    with_exec = {name for name, actions in granted.items() if actions & EXEC_ACTIONS}
    assert with_exec == {
        "BeatTaskRole",
        "beat-task-policy",
        "WebTaskRole",
        "web-task-policy",
    }
    for name in with_exec:
        assert EXEC_ACTIONS <= granted[name], name
    task_roles = {
        load_task_definition(role)["taskRoleArn"].rsplit("/", 1)[1]: role for role in WITH_EXEC
    }
    assert sorted(task_roles.values()) == sorted(WITH_EXEC)


# --- what the alarms and the dashboard read: metrics the report sends --------------------------

QUEUE = Settings.model_fields["queue"].default
TEMPLATE_VALUES = {
    "${QueueName}": QUEUE,
    "${MetricsNamespace}": "Mailpipe",
    "${AWS::Region}": "us-east-1",
}


def emitted_metrics() -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """(name, dimensions) of every datapoint a report may send, from mailpipe.operations.metrics
    itself: every queue's reading, the email queue's with every fleet figure set."""
    settings = Settings.model_construct(queue=QUEUE)
    email, *others = job_queues(settings)
    jobs = stage_jobs(
        [(stage.value, "succeeded", datetime(2025, 1, 1), datetime(2025, 1, 1)) for stage in Stage]
    )
    readings = [
        BacklogMetrics(
            queue=email,
            queue_depth=1,
            oldest_job_age_s=1.0,
            running_tasks=1,
            failed_runs=1,
            deferrals=1,
            paused_stages=frozenset(),
            stage_jobs=jobs,
            oldest_mailbox_wait_s=1.0,
        ),
        *(
            BacklogMetrics(
                queue=q,
                queue_depth=1,
                oldest_job_age_s=1.0,
                running_tasks=1,
                oldest_mailbox_wait_s=1.0,
            )
            for q in others
        ),
    ]
    return {
        (e["MetricName"], frozenset((d["Name"], d["Value"]) for d in e["Dimensions"]))
        for reading in readings
        for e in metric_data(reading)
    }


def resolved(value) -> str:
    """A template value with the parameters' defaults put in."""
    if isinstance(value, str):
        return value
    if "Ref" in value:
        return TEMPLATE_VALUES["${" + value["Ref"] + "}"]
    text = value["Fn::Sub"]
    for name, default in TEMPLATE_VALUES.items():
        text = text.replace(name, default)
    return text


def test_the_emitted_metrics_are_read_from_the_module():
    """Guards the checks below: the set holds each stage's jobs and each queue's backlog."""
    emitted = emitted_metrics()
    assert ("JobDuration", frozenset({("Stage", "model")})) in emitted
    assert ("QueueDepth", frozenset({("Queue", f"{QUEUE}.model"), ("Lane", "bulk")})) in emitted
    assert ("RunningTasks", frozenset({("Queue", f"{QUEUE}.model")})) in emitted
    assert ("FailedRuns", frozenset({("Queue", f"{QUEUE}.model")})) not in emitted


LIVE = ("Lane", Lane.LIVE.value)
ALARMED = {
    # alarm: the metric, its queue (and lane) or stage
    "OldestJobAgeAlarm": ("OldestJobAgeSeconds", {("Queue", QUEUE), LIVE}),
    "ModelOldestJobAgeAlarm": ("OldestJobAgeSeconds", {("Queue", f"{QUEUE}.model"), LIVE}),
    "QueueDepthAlarm": ("QueueDepth", {("Queue", QUEUE), LIVE}),
    "ModelQueueDepthAlarm": ("QueueDepth", {("Queue", f"{QUEUE}.model"), LIVE}),
    "FailedRunsAlarm": ("FailedRuns", {("Queue", QUEUE)}),
    "MetricsMissingAlarm": ("BacklogPerTask", {("Queue", QUEUE), LIVE}),
    "CpuStagePausedAlarm": ("StagePaused", {("Stage", "cpu")}),
    "ModelStagePausedAlarm": ("StagePaused", {("Stage", "model")}),
    "CpuMailboxStarvedAlarm": ("OldestMailboxWaitSeconds", {("Stage", "cpu"), LIVE}),
    "ModelMailboxStarvedAlarm": ("OldestMailboxWaitSeconds", {("Stage", "model"), LIVE}),
}
# Alarms whose action is a scaling policy, not the topic.
# Each scale-out alarm reads its live lane's oldest job, as 0 while its stage is paused.
SCALING_ALARMS = {
    "WorkerLiveJobAgeAlarm": ({("Queue", QUEUE), LIVE}, "cpu"),
    "ModelLiveJobAgeAlarm": ({("Queue", f"{QUEUE}.model"), LIVE}, "model"),
}
PAUSED_IS_NO_WAIT = "IF(paused > 0, 0, age)"


def watched(props: dict) -> dict[str, tuple[str, frozenset]]:  # type: ignore[type-arg]
    """A metric-math alarm's metrics, by id: name and dimensions."""
    found = {}
    for query in props["Metrics"]:
        if "MetricStat" in query:
            metric = query["MetricStat"]["Metric"]
            dimensions = frozenset((d["Name"], resolved(d["Value"])) for d in metric["Dimensions"])
            found[query["Id"]] = (metric["MetricName"], dimensions)
    return found


@pytest.mark.parametrize("alarm", sorted(ALARMED))
def test_every_alarm_watches_a_metric_the_report_sends_and_notifies_the_topic(template, alarm):
    props = template["Resources"][alarm]["Properties"]
    dimensions = frozenset((d["Name"], resolved(d["Value"])) for d in props["Dimensions"])
    assert (props["MetricName"], dimensions) in emitted_metrics()
    assert (props["MetricName"], dimensions) == (ALARMED[alarm][0], frozenset(ALARMED[alarm][1]))
    assert props["Namespace"] == {"Ref": "MetricsNamespace"}
    assert props["AlarmActions"] == props["OKActions"] == [{"Ref": "AlarmTopicArn"}]
    assert template["Parameters"]["AlarmTopicArn"]["Type"] == "String"


@pytest.mark.parametrize(
    ("target", "queue"),
    [("WorkerScalableTarget", QUEUE), ("ModelScalableTarget", f"{QUEUE}.model")],
)
def test_each_service_scales_out_on_its_live_lane_s_oldest_job(template, target, queue):
    """A step policy on an alarm of the live lane's OldestJobAgeSeconds: scale out only, in
    proportion to the running tasks; scale-in is the target tracking policies'."""
    res = template["Resources"]
    [(name, policy)] = [
        (name, r["Properties"])
        for name, r in res.items()
        if r["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"
        and r["Properties"]["ScalingTargetId"] == {"Ref": target}
        and r["Properties"]["PolicyType"] == "StepScaling"
    ]
    config = policy["StepScalingPolicyConfiguration"]
    assert config["AdjustmentType"] == "PercentChangeInCapacity"
    assert config["MinAdjustmentMagnitude"] >= 1
    assert config["StepAdjustments"] == [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 50}]
    [alarm] = [
        r["Properties"]
        for r in res.values()
        if r["Type"] == "AWS::CloudWatch::Alarm"
        and r["Properties"]["AlarmActions"] == [{"Ref": name}]
    ]
    assert watched(alarm)["age"] == (
        "OldestJobAgeSeconds",
        frozenset({("Queue", queue), ("Lane", Lane.LIVE.value)}),
    )
    assert watched(alarm)["age"] in emitted_metrics()
    assert alarm["ComparisonOperator"] == "GreaterThanThreshold"
    assert {q["Id"]: q["MetricStat"]["Stat"] for q in alarm["Metrics"] if "MetricStat" in q} == {
        "age": "Maximum",
        "paused": "Maximum",
    }
    assert "OKActions" not in alarm  # nothing to undo: scale-in is the target tracking's


@pytest.mark.parametrize("alarm", sorted(SCALING_ALARMS))
def test_every_scaling_alarm_watches_a_metric_the_report_sends(template, alarm):
    props = template["Resources"][alarm]["Properties"]
    metrics = watched(props)
    assert set(metrics.values()) <= emitted_metrics()
    lane, stage = SCALING_ALARMS[alarm]
    assert metrics == {
        "age": ("OldestJobAgeSeconds", frozenset(lane)),
        "paused": ("StagePaused", frozenset({("Stage", stage)})),
    }
    [shown] = [query for query in props["Metrics"] if query.get("ReturnData", True)]
    assert shown["Expression"] == PAUSED_IS_NO_WAIT
    [action] = props["AlarmActions"]
    assert (
        template["Resources"][action["Ref"]]["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"
    )


def test_every_alarm_is_tested(template):
    resources = template["Resources"]
    alarms = {name for name, r in resources.items() if r["Type"] == "AWS::CloudWatch::Alarm"}
    assert alarms == set(ALARMED) | set(SCALING_ALARMS)


def test_the_failed_runs_alarm_points_at_the_console_and_the_cli(template):
    text = template["Resources"]["FailedRunsAlarm"]["Properties"]["AlarmDescription"]["Fn::Sub"]
    assert "${NamePrefix}-web service, path /failed" in text
    command = re.search(r"aws ecs execute-command .*", " ".join(text.split()))
    assert command is not None
    words = command[0].split()
    assert option_value(words, "--cluster") == "${ClusterName}"
    assert option_value(words, "--container") == container("web")["name"]
    assert "--interactive" in words
    assert '--command "mailpipe failed"' in command[0]
    # The alarm's text holds only names of the stack's parameters and resources.
    names = set(template["Parameters"]) | set(template["Resources"]) | {"AWS::Region"}
    assert set(re.findall(r"\$\{([^}]+)\}", text)) <= names


def option_value(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def dashboard_metrics(template: dict) -> list[tuple[str, str, frozenset[tuple[str, str]], dict]]:
    """(namespace, name, dimensions, options) of every metric the dashboard draws."""
    body = template["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    for name, default in TEMPLATE_VALUES.items():
        body = body.replace(name, default)
    assert "${" not in body, "a substitution the test does not know"
    rows = []
    for widget in json.loads(body)["widgets"]:
        for row in widget["properties"]["metrics"]:
            options = row[-1] if isinstance(row[-1], dict) else {}
            namespace, name, *pairs = row[:-1] if options else row
            dimensions = frozenset(zip(pairs[::2], pairs[1::2], strict=True))
            rows.append((namespace, name, dimensions, widget["properties"] | options))
    return rows


def test_the_dashboard_draws_only_metrics_the_report_sends(template):
    drawn = dashboard_metrics(template)
    assert {namespace for namespace, *_ in drawn} == {"Mailpipe"}
    assert {(name, dims) for _, name, dims, _ in drawn} <= emitted_metrics()


def test_the_dashboard_shows_both_queues_and_each_stage_s_jobs(template):
    drawn = {(name, dims): options for _, name, dims, options in dashboard_metrics(template)}
    for queue in (QUEUE, f"{QUEUE}.model"):
        for lane in Lane:
            for name in ("QueueDepth", "OldestJobAgeSeconds", "BacklogPerTask", "DeferredJobs"):
                dims = frozenset({("Queue", queue), ("Lane", lane.value)})
                assert (name, dims) in drawn, (name, queue, lane)
        assert ("RunningTasks", frozenset({("Queue", queue)})) in drawn, queue
    for stage in Stage:
        dims = frozenset({("Stage", stage.value)})
        for name in JOB_COUNT_NAMES:
            assert drawn[(name, dims)]["stat"] == "Sum", name
    # The percentiles: one line per stage and percentile.
    percentiles = {
        (dict(dims)["Stage"], options["stat"])
        for _, name, dims, options in dashboard_metrics(template)
        if name == "JobDuration"
    }
    assert percentiles == {(stage.value, p) for stage in Stage for p in ("p50", "p90")}


def test_a_silent_report_alarms_on_its_own(template):
    """No BacklogPerTask datapoint for 3 minutes is an alarm of its own: the target tracking
    alarms, which Auto Scaling owns, are not changed."""
    props = template["Resources"]["MetricsMissingAlarm"]["Properties"]
    assert props["TreatMissingData"] == "breaching"
    assert props["Statistic"] == "SampleCount"
    assert (props["ComparisonOperator"], props["Threshold"]) == ("LessThanThreshold", 1)
    assert props["Period"] * props["EvaluationPeriods"] == 180
    policies = [
        r["Properties"]["TargetTrackingScalingPolicyConfiguration"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"
        and r["Properties"]["PolicyType"] == "TargetTrackingScaling"
    ]
    assert not [config for config in policies if "TreatMissingData" in json.dumps(config)]


@pytest.mark.parametrize(
    ("alarm", "stage"), [("CpuStagePausedAlarm", Stage.CPU), ("ModelStagePausedAlarm", Stage.MODEL)]
)
def test_a_paused_stage_alarms(template, alarm, stage):
    props = template["Resources"][alarm]["Properties"]
    assert props["Dimensions"] == [{"Name": "Stage", "Value": stage.value}]
    assert (props["ComparisonOperator"], props["Threshold"]) == ("GreaterThanOrEqualToThreshold", 1)
    assert props["Statistic"] == "Maximum"
    assert props["TreatMissingData"] == "notBreaching"  # silence is the other alarm's
    # A pause alarms once it has lasted the parameter's minutes, 15 by default.
    assert (props["Period"], props["EvaluationPeriods"]) == (60, {"Ref": "StagePausedAlarmMinutes"})
    assert template["Parameters"]["StagePausedAlarmMinutes"]["Default"] == 15


# --- IAM ---------------------------------------------------------------------------------------

IAM_DOCUMENTS = sorted(p.stem for p in (DEPLOY / "iam").glob("*.json"))


@pytest.mark.parametrize("name", IAM_DOCUMENTS)
def test_iam_document_is_least_privilege(name):
    doc = iam_document(name)
    assert doc["Version"] == "2012-10-17"
    for statement in doc["Statement"]:
        assert statement["Effect"] == "Allow"
        assert not {"NotAction", "NotResource", "NotPrincipal"} & set(statement)
        actions = as_list(statement["Action"])
        assert all("*" not in action for action in actions), statement
        if "Principal" in statement:  # a trust policy
            assert actions == ["sts:AssumeRole"]
            # ECS's tasks, or Bedrock's batch inference jobs (the model batch role).
            service = "bedrock" if name == "bedrock-batch-trust-policy" else "ecs-tasks"
            assert statement["Principal"] == {"Service": f"{service}.amazonaws.com"}
            continue
        if "*" in as_list(statement["Resource"]):
            assert as_list(statement["Resource"]) == ["*"]
            for action in actions:
                assert action in STAR_RESOURCE_ACTIONS, f"{action} on Resource *"
                key = STAR_RESOURCE_ACTIONS[action]
                if key:
                    conditions = {k for c in statement["Condition"].values() for k in c}
                    assert key in conditions, statement
        else:
            assert all(r.startswith("arn:aws:") for r in as_list(statement["Resource"]))


def test_task_role_trust_is_limited_to_this_account():
    (statement,) = iam_document("ecs-tasks-trust-policy")["Statement"]
    assert statement["Condition"]["StringEquals"]["aws:SourceAccount"] == ACCOUNT
    assert statement["Condition"]["ArnLike"]["aws:SourceArn"].startswith("arn:aws:ecs:")


def test_bedrock_may_assume_the_model_batch_role_for_this_account_s_jobs_only():
    (statement,) = iam_document("bedrock-batch-trust-policy")["Statement"]
    assert statement["Principal"] == {"Service": "bedrock.amazonaws.com"}
    assert statement["Condition"]["StringEquals"]["aws:SourceAccount"] == ACCOUNT
    job_arn = statement["Condition"]["ArnLike"]["aws:SourceArn"]
    assert job_arn == f"arn:aws:bedrock:us-east-1:{ACCOUNT}:model-invocation-job/*"


def test_beat_passes_only_the_model_batch_role_and_only_to_bedrock():
    (statement,) = [
        s for s in iam_document("beat-task-policy")["Statement"] if s["Action"] == "iam:PassRole"
    ]
    assert statement["Resource"] == f"arn:aws:iam::{ACCOUNT}:role/mailpipe-model-batch"
    assert statement["Condition"] == {
        "StringEquals": {"iam:PassedToService": "bedrock.amazonaws.com"}
    }
    assert env("beat")["MAILPIPE_MODEL_BATCH_ROLE_ARN"] == statement["Resource"]


def test_metrics_are_limited_to_the_mailpipe_namespace():
    (statement,) = [
        s for s in iam_document("beat-task-policy")["Statement"] if s["Sid"] == "PutMetrics"
    ]
    assert statement["Condition"] == {"StringEquals": {"cloudwatch:namespace": "Mailpipe"}}


@pytest.mark.parametrize("role", ["worker", "web"])
def test_blob_grants_name_the_bucket_and_prefix_of_the_task_definition(role):
    """What each action may do is proven by running the role's code under its policy
    (tests/deploy/test_task_roles.py); here, that the files name the blob store the task
    definitions point at, so that the run there is the run in production."""
    bucket, prefix = env(role)["MAILPIPE_BLOB_URL"].removeprefix("s3://").split("/", 1)
    for statement in iam_document(f"{role}-task-policy")["Statement"]:
        if not any(a.startswith("s3:") for a in as_list(statement["Action"])):
            continue
        for resource in as_list(statement["Resource"]):
            assert resource == f"arn:aws:s3:::{bucket}" or resource.startswith(
                f"arn:aws:s3:::{bucket}/{prefix}/"
            ), resource


def test_the_worker_task_role_lists_only_its_blob_prefix(template):
    """ListBucket makes S3 answer a missing key with 404 (BlobMissing) instead of 403, which
    mailpipe reads as a fault of the whole fleet; the condition keeps the listing to the prefix."""
    (policy,) = template["Resources"]["WorkerTaskRole"]["Properties"]["Policies"]
    by_sid = {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}
    listing = by_sid["ListBlobPrefix"]
    assert listing["Resource"] == {"Fn::Sub": "arn:${AWS::Partition}:s3:::${BlobBucketName}"}
    assert listing["Condition"] == {
        "StringLikeIfExists": {"s3:prefix": [{"Fn::Sub": "${BlobPrefix}/*"}]}
    }


def test_model_role_reaches_only_its_model():
    by_sid = {s["Sid"]: s for s in iam_document("model-task-policy")["Statement"]}
    assert set(by_sid) == {"InvokeModel"}  # the fleet's metrics are beat's
    model = by_sid["InvokeModel"]
    assert as_list(model["Action"]) == ["bedrock:InvokeModel"]
    assert as_list(model["Resource"]) == [
        f"arn:aws:bedrock:{env('model')['MAILPIPE_BEDROCK_REGION']}::foundation-model/"
        f"{env('model')['MAILPIPE_BEDROCK_MODEL_ID']}"
    ]


def _actions_by_policy(template: dict) -> dict[str, set[str]]:
    """Every IAM action granted, by the standalone document or template resource granting it."""
    granted = {
        name: {a for s in iam_document(name)["Statement"] for a in as_list(s["Action"])}
        for name in IAM_DOCUMENTS
    }
    for name, res in template["Resources"].items():
        props = res["Properties"]
        if res["Type"] == "AWS::IAM::Role":
            documents = [p["PolicyDocument"] for p in props.get("Policies", [])]
        elif res["Type"] in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy"):
            documents = [props["PolicyDocument"]]
        else:
            continue
        granted[name] = {a for doc in documents for acts in _statements(doc).values() for a in acts}
    return granted


def test_only_the_model_task_role_may_invoke_bedrock(template):
    """The CPU stage hands the email off; only the model role's threads call the model. Beat's
    leader creates, reads and stops the model batches' jobs, and calls no model."""
    by_policy = _actions_by_policy(template)
    callers = {
        name
        for name, actions in by_policy.items()
        if any(a.lower().startswith("bedrock:") for a in actions)
    }
    assert callers == {"model-task-policy", "ModelTaskRole", "beat-task-policy", "BeatTaskRole"}
    for name in ("beat-task-policy", "BeatTaskRole"):
        assert {a for a in by_policy[name] if a.startswith("bedrock:")} == {
            "bedrock:CreateModelInvocationJob",
            "bedrock:GetModelInvocationJob",
            "bedrock:StopModelInvocationJob",
        }
    (statement,) = [
        s
        for s in template["Resources"]["ModelTaskRole"]["Properties"]["Policies"][0][
            "PolicyDocument"
        ]["Statement"]
        if s["Sid"] == "InvokeModel"
    ]
    assert statement["Resource"] == {
        "Fn::Sub": "arn:${AWS::Partition}:bedrock:${BedrockRegion}::foundation-model/${BedrockModelId}"
    }
    params = template["Parameters"]
    assert params["BedrockModelId"]["Default"] == env("model")["MAILPIPE_BEDROCK_MODEL_ID"]
    assert params["BedrockRegion"]["Default"] == env("model")["MAILPIPE_BEDROCK_REGION"]


def _statements(document: dict) -> dict[str, list[str]]:
    out = {}
    for statement in document["Statement"]:
        if "Fn::If" in statement:  # optional statement: compare its "true" branch
            statement = statement["Fn::If"][1]
        out[statement["Sid"]] = sorted(as_list(statement["Action"]))
    return out


STANDALONE_TWINS = {
    # template resource -> standalone documents of its policies
    "WorkerTaskRole": ["worker-task-policy"],
    "WorkerExecutionRole": ["worker-execution-policy"],
    "ModelTaskRole": ["model-task-policy"],
    "ModelExecutionRole": ["model-execution-policy"],
    "BeatTaskRole": ["beat-task-policy"],
    "BeatExecutionRole": ["beat-execution-policy"],
    "FlowerExecutionRole": ["flower-execution-policy"],
    "WebTaskRole": ["web-task-policy"],
    "WebExecutionRole": ["web-execution-policy"],
    "ModelBatchRole": ["model-batch-policy"],
    "ReleaseExecutionRole": ["release-execution-policy"],
    "ExecutionCommonPolicy": ["execution-common-policy"],
}


@pytest.mark.parametrize("resource", sorted(STANDALONE_TWINS))
def test_standalone_iam_documents_match_the_template(template, resource):
    props = template["Resources"][resource]["Properties"]
    inline = [p["PolicyDocument"] for p in props.get("Policies", [])] or [props["PolicyDocument"]]
    in_template = {sid: acts for doc in inline for sid, acts in _statements(doc).items()}
    standalone = {
        sid: acts
        for name in STANDALONE_TWINS[resource]
        for sid, acts in _statements(iam_document(name)).items()
    }
    assert in_template == standalone
    if template["Resources"][resource]["Type"] == "AWS::IAM::Role":
        trust = (
            "bedrock-batch-trust-policy"
            if resource == "ModelBatchRole"
            else "ecs-tasks-trust-policy"
            if resource.endswith("TaskRole")
            else "ecs-execution-trust-policy"
        )
        assert _statements(props["AssumeRolePolicyDocument"]) == _statements(iam_document(trust))


def test_every_iam_document_is_used():
    used = {n for names in STANDALONE_TWINS.values() for n in names}
    used |= {"ecs-tasks-trust-policy", "ecs-execution-trust-policy", "bedrock-batch-trust-policy"}
    assert set(IAM_DOCUMENTS) == used
