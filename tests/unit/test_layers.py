"""The layers of the package, and which ones each layer pulls in when imported in a clean
interpreter (as far as mailpipe goes: `tests.support.forked`): imports run one way, from the
command line and the Celery face down to storage.

    .venv/bin/pytest tests/unit/test_layers.py -s      # prints the table
"""

from __future__ import annotations

import json

import pytest

from tests.support.forked import run_forked

# Bottom to top. A layer may import the layers before it in this list, never one after it;
# storage, coordination, mail and classifiers are peers that do not import one another.
LAYERS = {
    "base": ("mailpipe", "mailpipe.settings", "mailpipe.errors"),
    "storage": ("mailpipe.storage",),
    "broker": ("mailpipe.broker",),
    "coordination": ("mailpipe.coordination",),
    "mail": ("mailpipe.mail",),
    "classifiers": ("mailpipe.classifiers",),
    "resources": ("mailpipe.resources",),
    "pipeline": ("mailpipe.pipeline",),
    "operations": ("mailpipe.operations",),
    "app": ("mailpipe.app", "mailpipe.celery", "mailpipe.enqueue"),
    "web": ("mailpipe.web",),
    "cli": ("mailpipe.cli",),
}

# What importing each module pulls in, as layers.
EXPECTED = {
    "mailpipe.settings": {"base"},
    "mailpipe.storage.models": {"base", "storage"},
    "mailpipe.storage.flags": {"base", "storage"},
    "mailpipe.storage.migrate": {"base", "storage"},
    "mailpipe.coordination.leases": {"base", "broker", "coordination"},
    "mailpipe.coordination.heartbeat": {"base", "broker", "coordination"},
    "mailpipe.coordination.ratelimit": {"base", "broker", "coordination"},
    "mailpipe.mail.parse": {"base", "mail"},
    "mailpipe.mail.documents": {"base", "mail"},
    "mailpipe.classifiers.rules": {"base", "classifiers"},
    "mailpipe.classifiers.bedrock": {"base", "classifiers"},
    "mailpipe.resources": {"base", "resources"},
    # The policy: the storage layer's enums of outcomes and error classes, nothing that calls out.
    "mailpipe.pipeline.policy": {"base", "storage", "pipeline"},
    "mailpipe.pipeline.job": {
        "base",
        "storage",
        "broker",
        "coordination",
        "mail",
        "classifiers",
        "resources",
        "pipeline",
    },
    "mailpipe.operations.sweeper": {
        "base",
        "storage",
        "broker",
        "coordination",
        "resources",
        "pipeline",
        "operations",
    },
    # The pipeline's stage pauses only (what Redis lost is put back from the database): no
    # document converter, no classifier.
    "mailpipe.operations.status": {
        "base",
        "storage",
        "broker",
        "coordination",
        "resources",
        "pipeline",
        "operations",
    },
    # Upstream code's entry point: the app, the markers; no pipeline, no document converter.
    "mailpipe.enqueue": {"base", "broker", "coordination", "resources", "app"},
    "mailpipe.app.tasks": {
        "base",
        "storage",
        "broker",
        "coordination",
        "mail",
        "classifiers",
        "resources",
        "pipeline",
        "operations",
        "app",
    },
    # The console: what it shows and does, and the deduplicated enqueue its retries go through.
    "mailpipe.web.app": {
        "base",
        "storage",
        "broker",
        "coordination",
        # The search reads a Message-ID as the parser does (mail.headers).
        "mail",
        "resources",
        "pipeline",
        "operations",
        "app",
        "web",
    },
    "mailpipe.cli.main": {"base", "resources", "cli"},
    # The worker the demo starts, as the tests and benchmarks start theirs: no app, no pipeline.
    "mailpipe.cli.demo.fleet": {"base", "cli"},
}

# Libraries an upstream process that only enqueues must not pay for.
CONVERTERS = ("pypdf", "docx", "openpyxl", "numpy", "boto3", "sqlalchemy")

# Imported once before the modules above are, each in a child of that interpreter: the libraries
# that take most of an import's time. One left out costs time, not correctness.
LIBRARIES = (
    "alembic",
    "boto3",
    "bs4",
    "celery.app",
    "celery.worker",
    "click",
    "docx",
    "email.policy",
    "jinja2",
    "kombu.transport.redis",
    "openpyxl",
    "psycopg",
    "pydantic_settings",
    "pypdf",
    "redis",
    "rich",
    "sqlalchemy.dialects.postgresql",
    "sqlalchemy.orm",
    "starlette.applications",
)

_PROBE = """
import importlib, json, sys
importlib.import_module({module!r})
print(json.dumps(sorted(sys.modules)))
"""


def layer_of(module: str) -> str | None:
    found = [
        (len(prefix), name)
        for name, prefixes in LAYERS.items()
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(found)[1] if found else None


def imported(modules: list[str], preload: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The modules loaded after importing each of `modules`, each in a child of its own."""
    found = run_forked([(_PROBE.format(module=module), {}) for module in modules], preload)
    return dict(zip(modules, map(json.loads, found), strict=True))


@pytest.fixture(scope="module")
def pulled_in() -> dict[str, list[str]]:
    return imported(sorted(EXPECTED), LIBRARIES)


@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_each_layer_pulls_in_only_the_layers_below_it(
    module: str, pulled_in: dict[str, list[str]]
) -> None:
    layers = {layer for layer in map(layer_of, pulled_in[module]) if layer is not None}
    print(f"\n{module:<34} -> {', '.join(name for name in LAYERS if name in layers)}")
    assert layers == EXPECTED[module]


def test_the_expected_layers_respect_the_order() -> None:
    order = list(LAYERS)
    peers = {"storage", "coordination", "mail", "classifiers"}
    for module, layers in EXPECTED.items():
        own = layer_of(module)
        assert own is not None and own in layers
        for layer in layers - {own}:
            assert order.index(layer) < order.index(own), (module, layer)
            assert not (own in peers and layer in peers), (module, layer)


def test_enqueueing_imports_no_document_converter_nor_storage_library() -> None:
    # Nothing imported before: the libraries are what this test is about.
    modules = imported(["mailpipe.enqueue"])["mailpipe.enqueue"]
    assert not [m for m in modules if m.split(".")[0] in CONVERTERS]
