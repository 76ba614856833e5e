"""Every task keeps what a released message may carry (docs/decisions/message-compatibility.md).

`RELEASED` is each task's keyword arguments as the releases so far send them, with the default
that keeps a message without the field meaning what it meant. A parameter lost, a default
changed, or a new parameter without a default fails here: the previous release's messages (and
the next release's) must run on this one's workers during a rolling deploy.
"""

from __future__ import annotations

import inspect

import pytest

from mailpipe.app import tasks
from mailpipe.broker.queues import TaskName

REQUIRED = inspect.Parameter.empty
RELEASED: dict[TaskName, dict[str, object]] = {
    TaskName.PROCESS_EMAIL: {
        "email_id": REQUIRED,
        "deferred_since": None,
        "cut_off": None,
        "lane": "live",
    },
    TaskName.CLASSIFY_EMAIL: {"email_id": REQUIRED, "deferred_since": None, "lane": "live"},
    TaskName.SWEEP: {},
}


def parameters(name: TaskName) -> dict[str, inspect.Parameter]:
    task = tasks.app.tasks[name.value]
    return dict(inspect.signature(task.run).parameters)


@pytest.mark.parametrize("name", list(RELEASED))
def test_a_task_keeps_every_released_argument_and_its_default(name: TaskName) -> None:
    found = parameters(name)
    for argument, default in RELEASED[name].items():
        assert argument in found, f"{name}: {argument} was released and must stay"
        assert found[argument].default == default, f"{name}: {argument}'s default changed"


@pytest.mark.parametrize("name", list(RELEASED))
def test_a_task_adds_only_arguments_with_defaults_and_accepts_unknown_ones(
    name: TaskName,
) -> None:
    found = parameters(name)
    kinds = {p.kind for p in found.values()}
    assert inspect.Parameter.VAR_KEYWORD in kinds, f"{name} must accept arguments it does not know"
    added = {
        argument: p
        for argument, p in found.items()
        if argument not in RELEASED[name] and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    assert not [a for a, p in added.items() if p.default is REQUIRED], (
        f"{name}: a new argument needs a default that keeps the old meaning"
    )


def test_every_task_is_listed() -> None:
    assert set(RELEASED) == set(TaskName)
