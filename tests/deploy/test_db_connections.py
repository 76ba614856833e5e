"""The fleet's PostgreSQL connections: the template's check (`DbConnectionsCheck`) counts each role
as its task definition runs it, adds them up to the figures of docs/scaling.md ("PostgreSQL
connections"), and fails the stack past `MaxDbConnections`.

The check's inline function runs here as Lambda would run it, on CloudFormation's event, and
answers a loopback server standing in for the presigned URL CloudFormation waits on. No AWS call.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from cfnlint.decode import decode

from mailpipe.broker.queues import Stage
from mailpipe.settings import Settings
from tests.support.cloudformation import function_of, invoke, resolved, responses

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "cloudformation" / "mailpipe.yaml"
SCALING = ROOT / "docs" / "scaling.md"
CHECK = "DbConnectionsCheck"
# Each service's role, by the stack resource that runs it.
SERVICES = {
    "worker": "WorkerService",
    "model": "ModelService",
    "beat": "BeatService",
    "web": "WebService",
    "flower": "FlowerService",
}


@pytest.fixture(scope="module")
def template() -> dict:
    tpl, matches = decode(str(TEMPLATE))
    assert not matches, matches
    return tpl


def check_roles(template: dict) -> dict[str, dict]:
    roles = template["Resources"][CHECK]["Properties"]["Roles"]
    return {role["Role"]: role for role in roles}


def task_definition(role: str) -> dict:
    (only,) = json.loads((ROOT / "deploy" / "ecs" / f"{role}.json").read_text())[
        "containerDefinitions"
    ]
    return only


def task_settings(role: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the role's task runs with: its environment over the app's defaults."""
    for name in [n for n in os.environ if n.startswith("MAILPIPE_")]:
        monkeypatch.delenv(name)
    env = {e["name"]: e["value"] for e in task_definition(role).get("environment", [])}
    return Settings(
        **{
            k.removeprefix("MAILPIPE_").lower(): v
            for k, v in env.items()
            if k.startswith("MAILPIPE_")
        }
    )


def connects(role: str) -> bool:
    return any(
        s["name"] == "MAILPIPE_DATABASE_URL" for s in task_definition(role).get("secrets", [])
    )


def test_the_check_counts_each_role_as_its_task_definition_runs_it(template, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    roles = check_roles(template)
    with_database = {r for r in (*SERVICES, "release") if connects(r)}
    assert set(roles) == with_database | {"probes"}
    resources = template["Resources"]
    for role in with_database:
        counted = roles[role]
        # An engine per process: its pool, and as many again in a burst (mailpipe/storage/db.py).
        settings = task_settings(role, monkeypatch)
        if role == "release":  # Alembic's one connection
            assert counted["ConnectionsPerProcess"] == 1
        elif role == "web":  # and a connection per search at once (Resources.searches)
            per_process = 2 * settings.db_pool_size + settings.web_searches
            assert counted["ConnectionsPerProcess"] == per_process
        else:
            assert counted["ConnectionsPerProcess"] == 2 * settings.db_pool_size, role
        command = task_definition(role)["command"]
        if role == "worker":  # a prefork child per concurrency slot; the main process has none
            assert "--pool=threads" not in command
            assert counted["ProcessesPerTask"] == settings.worker_concurrency
        else:  # one process; the model role's threads share its engine
            assert role != "model" or "--pool=threads" in command
            assert counted["ProcessesPerTask"] == 1, role
        if role == "release":
            assert (counted["Tasks"], counted["MaximumPercent"]) == (1, 100)
            continue
        service = resources[SERVICES[role]]["Properties"]
        assert counted["MaximumPercent"] == service["DeploymentConfiguration"]["MaximumPercent"]
        if "DesiredCount" in service:
            assert counted["Tasks"] == service["DesiredCount"], role
        else:  # auto scaling owns the count: its maximum
            target = f"{role.capitalize()}ScalableTarget"
            assert counted["Tasks"] == resources[target]["Properties"]["MaxCapacity"], role
    # A stage's probe, one at a time per stage in the fleet, on one connection.
    probes = roles["probes"]
    assert (probes["Tasks"], probes["ProcessesPerTask"], probes["ConnectionsPerProcess"]) == (
        1,
        len(Stage),
        1,
    )


def test_no_maximum_is_set_before_the_check_passes(template) -> None:  # type: ignore[no-untyped-def]
    resources = template["Resources"]
    for target in ("WorkerScalableTarget", "ModelScalableTarget"):
        assert resources[target]["DependsOn"] == CHECK


# --- the check's function, run -------------------------------------------------------------------


@pytest.fixture(scope="module")
def check(template):  # type: ignore[no-untyped-def]
    """Run the check's function on an event of `request_type` with the template's defaults and
    `parameters`; returns the answer CloudFormation received."""
    function = function_of(template, "DbConnectionsCheckFunction")
    with responses() as taken:

        def run(request_type: str = "Create", **parameters: Any) -> tuple[dict[str, str], dict]:
            return invoke(template, function, CHECK, taken, request_type, parameters)

        run.connections = function["connections"]  # type: ignore[attr-defined]
        yield run


def documented() -> dict[str, tuple[int, int]]:
    """docs/scaling.md's table of connections: each role's figures between deployments and
    through a rolling deployment, and the fleet's as `fleet`."""
    page = SCALING.read_text()
    section = page.split("\n## PostgreSQL connections\n", 1)[1].split("\n## ", 1)[0]
    figures = {}
    for line in section.splitlines():
        cells = [c.strip().replace("*", "") for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"\d+", cells[5]):
            steady = int(re.findall(r"\d+", cells[4])[-1])
            figures[cells[0]] = (steady, int(cells[5]))
    return figures


def test_the_check_adds_up_the_figures_of_the_scaling_page(template, check) -> None:  # type: ignore[no-untyped-def]
    doc = documented()
    steady, deploying = doc["fleet"]
    defaults = {name: p.get("Default") for name, p in template["Parameters"].items()}
    roles = resolved(list(check_roles(template).values()), defaults)
    for role in roles:
        assert check.connections([role]) == doc[role["Role"]], role["Role"]
    counted = {role["Role"] for role in roles}
    assert all(
        figures == (0, 0) for name, figures in doc.items() if name not in counted | {"fleet"}
    )

    headers, answer = check(MaxDbConnections=deploying)
    assert answer["Status"] == "SUCCESS", answer["Reason"]
    assert answer["Data"] == {"Connections": deploying, "SteadyConnections": steady}
    # What CloudFormation reads from the presigned URL: no content type, which its signature
    # leaves out, and the event's identifiers.
    assert headers["Content-Type"] == ""
    assert (answer["LogicalResourceId"], answer["PhysicalResourceId"]) == (CHECK, CHECK)
    assert answer["RequestId"] == "request-1" and answer["StackId"].endswith("stack/mailpipe/1")


def test_the_check_fails_the_stack_when_max_db_connections_is_lower(check) -> None:  # type: ignore[no-untyped-def]
    steady, deploying = documented()["fleet"]
    for request in ("Create", "Update"):
        _, answer = check(request, MaxDbConnections=deploying - 1)
        assert answer["Status"] == "FAILED"
        assert f"{deploying} PostgreSQL connections" in answer["Reason"]
        assert f"({steady} between deployments)" in answer["Reason"]
        assert f"MaxDbConnections ({deploying - 1})" in answer["Reason"]
    # Fewer workers at most fit again.
    _, answer = check(MaxDbConnections=deploying - 1, WorkerMaxTasks=39)
    assert answer["Status"] == "SUCCESS"


def test_a_delete_always_succeeds_so_that_a_rollback_never_sticks(check) -> None:  # type: ignore[no-untyped-def]
    _, answer = check("Delete", MaxDbConnections=1)
    assert answer["Status"] == "SUCCESS"


def test_an_error_fails_the_stack_with_its_reason_not_a_timeout(check) -> None:  # type: ignore[no-untyped-def]
    _, answer = check(MaxDbConnections="many")
    assert answer["Status"] == "FAILED"
    assert answer["Reason"].startswith("ValueError: ")
