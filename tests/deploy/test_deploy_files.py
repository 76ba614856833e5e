"""The deploy files are well formed and keep the promises the app relies on.

Offline checks only: task definitions against botocore's own ECS model, the template through
cfn-lint, IAM documents by inspection, the Dockerfile by parsing. No AWS call, no Docker engine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import botocore.session
import pytest
from botocore.validate import ParamValidator
from cfnlint.decode import decode

from mailpipe.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TEMPLATE = DEPLOY / "cloudformation" / "mailpipe.yaml"
ROLES = ("worker", "beat", "flower", "release")
SERVICES = ("worker", "beat", "flower")  # long-running; release is a one-off run-task
ACCOUNT = "123456789012"

# Fargate's allowed task sizes: cpu units -> memory MiB.
FARGATE_SIZES = {
    256: {512, 1024, 2048},
    512: set(range(1024, 4097, 1024)),
    1024: set(range(2048, 8193, 1024)),
    2048: set(range(4096, 16385, 1024)),
    4096: set(range(8192, 30721, 1024)),
}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|BASIC_AUTH|API_KEY|ACCESS_KEY|CREDENTIAL", re.I)
# Actions AWS only authorises on Resource "*"; each must be narrowed some other way if it can be.
STAR_RESOURCE_ACTIONS = {
    "cloudwatch:PutMetricData": "cloudwatch:namespace",  # narrowed by this condition key
    "ecr:GetAuthorizationToken": None,  # a token for the registry, no resource type exists
}


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
    assert mounts <= set(dockerfile_volumes())


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
        "worker": ["celery", "-A", "mailpipe", "worker", "--loglevel", "INFO"],
        "beat": ["celery", "-A", "mailpipe", "beat", "--loglevel", "INFO"],
        "flower": ["celery", "-A", "mailpipe", "flower", "--conf", "/etc/mailpipe/flowerconfig.py", "--port", "5555"],
        "release": ["mailpipe", "db", "upgrade"],
    }[role]
    assert c["command"] == expected
    assert "entryPoint" not in c, "tini stays PID 1 only through the image's ENTRYPOINT"


@pytest.mark.parametrize("role", SERVICES)
def test_long_running_roles_have_a_health_check(role):
    check = container(role)["healthCheck"]
    assert check["command"][0] in ("CMD", "CMD-SHELL") and len(check["command"]) >= 2
    assert check["timeout"] < check["interval"]
    assert check["retries"] >= 2


def test_worker_health_check_pings_this_worker_only():
    kind, command = container("worker")["healthCheck"]["command"]
    assert kind == "CMD-SHELL"
    args = shlex.split(command)
    assert args[:5] == ["celery", "-A", "mailpipe", "inspect", "ping"]
    # celery@<hostname> is the worker's default node name; without --destination any worker answers.
    assert args[args.index("--destination") + 1] == "celery@$(hostname)"
    timeout = float(args[args.index("--timeout") + 1])
    assert timeout < container("worker")["healthCheck"]["timeout"]


def test_beat_health_check_cannot_match_its_own_shell():
    # CMD-SHELL would run `sh -c 'pgrep -f "...beat"'`, whose own command line matches the
    # pattern: the check would pass with beat dead. The exec form has no such shell.
    command = container("beat")["healthCheck"]["command"]
    assert command[:3] == ["CMD", "pgrep", "-f"]
    pattern = command[3]
    beat_cmdline = "/opt/venv/bin/python /opt/venv/bin/celery -A mailpipe beat --loglevel INFO"
    tini_cmdline = "tini -- celery -A mailpipe beat --loglevel INFO"
    assert re.search(pattern, beat_cmdline) and not re.search(pattern, tini_cmdline)


def test_flower_health_check_uses_the_unauthenticated_endpoint():
    command = container("flower")["healthCheck"]["command"]
    assert command[0] == "CMD"
    assert "http://127.0.0.1:5555/healthcheck" in " ".join(command)
    assert container("flower")["portMappings"][0]["containerPort"] == 5555


def test_worker_stops_through_celery_soft_shutdown():
    c = container("worker")
    assert c["stopTimeout"] == 120
    assert env("worker")["REMAP_SIGTERM"] == "SIGQUIT"
    soft = float(
        env("worker").get(
            "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT", Settings.model_fields["soft_shutdown_timeout"].default
        )
    )
    assert soft == 90
    # Celery still has to requeue the unfinished jobs and exit after the soft window, before ECS
    # sends SIGKILL at stopTimeout.
    assert soft + 10 <= c["stopTimeout"]


def test_worker_settings_pass_the_app_time_budget_check(monkeypatch):
    # Only the task definition and the app defaults count, not the test suite's short timeouts.
    for name in [n for n in os.environ if n.startswith("MAILPIPE_")]:
        monkeypatch.delenv(name)
    values = {
        k.removeprefix("MAILPIPE_").lower(): v
        for k, v in env("worker").items()
        if k.startswith("MAILPIPE_")
    }
    settings = Settings(**values)  # raises when the time budget rule is broken
    assert settings.worker_concurrency == 2
    assert settings.metrics_namespace == "Mailpipe"
    assert settings.blob_url.startswith("s3://")


def test_every_broker_client_uses_the_same_visibility_timeout():
    timeouts = {
        role: env(role).get("MAILPIPE_VISIBILITY_TIMEOUT")
        for role in ROLES
        if "MAILPIPE_BROKER_URL" in secrets(role)
    }
    assert set(timeouts) == {"worker", "beat", "flower"}
    assert set(timeouts.values()) == {"900"}, timeouts


@pytest.mark.parametrize("role", ROLES)
def test_no_literal_secret_in_the_environment(role):
    for name, value in env(role).items():
        assert not SECRET_NAME.search(name), name
        assert not (name.endswith("_URL") and "@" in value), name
        assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", value), name
    for required in ("MAILPIPE_DATABASE_URL", "MAILPIPE_BROKER_URL", "MAILPIPE_FLOWER_BASIC_AUTH"):
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
    assert set(secrets("beat")) == {"MAILPIPE_BROKER_URL"}
    assert set(secrets("flower")) == {"MAILPIPE_BROKER_URL", "MAILPIPE_FLOWER_BASIC_AUTH"}
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
    if role in ("worker", "beat"):
        task = td["taskRoleArn"].removeprefix(f"arn:aws:iam::{ACCOUNT}:role/")
        assert task == f"mailpipe-{role}-task" and task in stack_roles
    else:
        assert "taskRoleArn" not in td, "no AWS API calls, so no credentials"


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
    assert resolved and all(re.fullmatch(r"python:3\.11-slim(-\w+)?", b) for b in resolved)


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
    for needed in ("pyproject.toml", "celeryconfig.py", "mailpipe"):
        assert needed in sources
    # Dependencies are installed before the source is copied, so code changes reuse that layer.
    instructions = dockerfile_instructions()
    first_source = next(
        i for i, (k, v) in enumerate(instructions) if k == "COPY" and "mailpipe" in v.split()
    )
    deps = next(
        i for i, (k, v) in enumerate(instructions) if k == "RUN" and "requirements.txt" in v
    )
    assert deps < first_source


def test_dockerignore_applies_to_the_documented_build():
    # `docker build -f deploy/Dockerfile .` reads deploy/Dockerfile.dockerignore; a file named
    # deploy/.dockerignore would not apply to that build context.
    patterns = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert patterns[patterns.index("*") + 1 :].count("!mailpipe/") == 1
    assert "!pyproject.toml" in patterns and "!celeryconfig.py" in patterns


# --- CloudFormation ----------------------------------------------------------------------------


def cfn_lint(path: Path) -> list[dict]:
    exe = Path(sys.executable).parent / "cfn-lint"
    proc = subprocess.run(
        [str(exe), "--format", "json", "--", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode in (0, 2, 4, 6, 8, 10, 12, 14), proc.stderr
    return json.loads(proc.stdout or "[]")


def test_template_passes_cfn_lint():
    findings = cfn_lint(TEMPLATE)
    problems = [f for f in findings if f["Level"] in ("Error", "Warning")]
    assert not problems, json.dumps(problems, indent=1)


def test_cfn_lint_catches_a_broken_template(tmp_path):
    broken = tmp_path / "broken.yaml"
    text = TEMPLATE.read_text().replace(
        "ScalableDimension: ecs:service:DesiredCount", "ScalableDimension: ecs:service:Desired"
    )
    broken.write_text(text.replace("Statistic: Maximum", "Statistic: Largest"))
    assert [f for f in cfn_lint(broken) if f["Level"] == "Error"]


def test_worker_scales_on_backlog_per_task(template):
    res = template["Resources"]
    target = res["WorkerScalableTarget"]["Properties"]
    assert target["ScalableDimension"] == "ecs:service:DesiredCount"
    assert target["ResourceId"] == {"Fn::Sub": "service/${ClusterName}/${WorkerService.Name}"}
    params = template["Parameters"]
    assert params["WorkerMinTasks"]["MinValue"] >= 1  # the metric needs a running worker
    config = res["WorkerBacklogScalingPolicy"]["Properties"][
        "TargetTrackingScalingPolicyConfiguration"
    ]
    assert res["WorkerBacklogScalingPolicy"]["Properties"]["PolicyType"] == "TargetTrackingScaling"
    metric = config["CustomizedMetricSpecification"]
    assert metric["MetricName"] == "BacklogPerTask"
    assert metric["Namespace"] == {"Ref": "MetricsNamespace"}
    assert params["MetricsNamespace"]["Default"] == "Mailpipe"
    assert metric["Dimensions"] == [{"Name": "Queue", "Value": {"Ref": "QueueName"}}]
    assert params["QueueName"]["Default"] == "mailpipe"
    assert config["TargetValue"] == {"Ref": "BacklogPerTaskTarget"}
    assert config["ScaleOutCooldown"] == {"Ref": "ScaleOutCooldownSeconds"}
    assert config["ScaleInCooldown"] == {"Ref": "ScaleInCooldownSeconds"}
    assert config["DisableScaleIn"] is False


def test_services(template):
    res = template["Resources"]
    worker = res["WorkerService"]["Properties"]
    assert "DesiredCount" not in worker, "auto scaling owns the worker count"
    assert res["BeatService"]["Properties"]["DesiredCount"] == 1
    assert res["FlowerService"]["Properties"]["DesiredCount"] == 1
    for name in ("WorkerService", "BeatService", "FlowerService"):
        props = res[name]["Properties"]
        assert props["LaunchType"] == "FARGATE"
        assert props["NetworkConfiguration"]["AwsvpcConfiguration"]["AssignPublicIp"] == "DISABLED"
        assert props["DeploymentConfiguration"]["DeploymentCircuitBreaker"]["Enable"] is True
    assert "ClusterName" in template["Parameters"]


@pytest.mark.parametrize(
    ("alarm", "metric"),
    [("OldestJobAgeAlarm", "OldestJobAgeSeconds"), ("FailedRunsAlarm", "FailedRuns")],
)
def test_alarms_notify_the_topic(template, alarm, metric):
    props = template["Resources"][alarm]["Properties"]
    assert props["MetricName"] == metric
    assert props["Namespace"] == {"Ref": "MetricsNamespace"}
    assert props["Dimensions"] == [{"Name": "Queue", "Value": {"Ref": "QueueName"}}]
    assert props["AlarmActions"] == [{"Ref": "AlarmTopicArn"}]
    assert template["Parameters"]["AlarmTopicArn"]["Type"] == "String"


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
            assert statement["Principal"] == {"Service": "ecs-tasks.amazonaws.com"}
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


def test_metrics_are_limited_to_the_mailpipe_namespace():
    for name in ("worker-task-policy", "beat-task-policy"):
        (statement,) = [s for s in iam_document(name)["Statement"] if s["Sid"] == "PutMetrics"]
        assert statement["Condition"] == {"StringEquals": {"cloudwatch:namespace": "Mailpipe"}}


def test_worker_reaches_only_its_blob_prefix_and_model():
    by_sid = {s["Sid"]: s for s in iam_document("worker-task-policy")["Statement"]}
    blobs = by_sid["ReadWriteBlobs"]
    assert sorted(as_list(blobs["Action"])) == ["s3:GetObject", "s3:PutObject"]
    bucket, prefix = env("worker")["MAILPIPE_BLOB_URL"].removeprefix("s3://").split("/", 1)
    assert as_list(blobs["Resource"]) == [f"arn:aws:s3:::{bucket}/{prefix}/*"]
    model = by_sid["InvokeModel"]
    assert as_list(model["Action"]) == ["bedrock:InvokeModel"]
    assert as_list(model["Resource"]) == [
        f"arn:aws:bedrock:{env('worker')['MAILPIPE_BEDROCK_REGION']}::foundation-model/"
        f"{env('worker')['MAILPIPE_BEDROCK_MODEL_ID']}"
    ]


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
    "BeatTaskRole": ["beat-task-policy"],
    "WorkerExecutionRole": ["worker-execution-policy"],
    "BeatExecutionRole": ["beat-execution-policy"],
    "FlowerExecutionRole": ["flower-execution-policy"],
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
            "ecs-tasks-trust-policy"
            if resource.endswith("TaskRole")
            else "ecs-execution-trust-policy"
        )
        assert _statements(props["AssumeRolePolicyDocument"]) == _statements(iam_document(trust))


def test_every_iam_document_is_used():
    used = {n for names in STANDALONE_TWINS.values() for n in names}
    used |= {"ecs-tasks-trust-policy", "ecs-execution-trust-policy"}
    assert set(IAM_DOCUMENTS) == used
