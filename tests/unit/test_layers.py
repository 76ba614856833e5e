"""The layers of the package, and which ones each layer pulls in when imported in a clean
interpreter: imports run one way, from the command line and the Celery face down to storage.

    .venv/bin/pytest tests/unit/test_layers.py -s      # prints the table
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Bottom to top. A layer may import the layers before it in this list, never one after it; the
# four middle ones are peers that do not import one another.
LAYERS = {
    "base": ("mailpipe", "mailpipe.settings", "mailpipe.errors"),
    "storage": ("mailpipe.storage",),
    "coordination": ("mailpipe.coordination",),
    "mail": ("mailpipe.mail",),
    "classifiers": ("mailpipe.classifiers",),
    "resources": ("mailpipe.resources",),
    "pipeline": ("mailpipe.pipeline",),
    "operations": ("mailpipe.operations",),
    "app": ("mailpipe.app", "mailpipe.celery", "mailpipe.enqueue"),
    "cli": ("mailpipe.cli",),
}

# What importing each module pulls in, as layers.
EXPECTED = {
    "mailpipe.settings": {"base"},
    "mailpipe.storage.models": {"base", "storage"},
    "mailpipe.storage.flags": {"base", "storage"},
    "mailpipe.storage.migrate": {"base", "storage"},
    "mailpipe.coordination.leases": {"base", "coordination"},
    "mailpipe.coordination.heartbeat": {"base", "coordination"},
    "mailpipe.coordination.ratelimit": {"base", "coordination"},
    "mailpipe.mail.parse": {"base", "mail"},
    "mailpipe.mail.documents": {"base", "mail"},
    "mailpipe.classifiers.rules": {"base", "classifiers"},
    "mailpipe.classifiers.bedrock": {"base", "classifiers"},
    "mailpipe.resources": {"base", "resources"},
    "mailpipe.pipeline.job": {
        "base",
        "storage",
        "coordination",
        "mail",
        "classifiers",
        "resources",
        "pipeline",
    },
    "mailpipe.operations.sweeper": {
        "base",
        "storage",
        "coordination",
        "resources",
        "pipeline",
        "operations",
    },
    "mailpipe.operations.status": {"base", "storage", "coordination", "resources", "operations"},
    # Upstream code's entry point: the app, the markers; no pipeline, no document converter.
    "mailpipe.enqueue": {"base", "coordination", "resources", "app"},
    "mailpipe.app.tasks": {
        "base",
        "storage",
        "coordination",
        "mail",
        "classifiers",
        "resources",
        "pipeline",
        "operations",
        "app",
    },
    "mailpipe.cli.main": {"base", "resources", "cli"},
    # The worker the demo starts, as the tests and benchmarks start theirs: no app, no pipeline.
    "mailpipe.cli.demo.fleet": {"base", "cli"},
}

# Libraries an upstream process that only enqueues must not pay for.
CONVERTERS = ("pypdf", "docx", "openpyxl", "numpy", "boto3", "sqlalchemy")

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
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


def imported(module: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, module], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_each_layer_pulls_in_only_the_layers_below_it(module: str) -> None:
    modules = imported(module)
    layers = {layer for layer in map(layer_of, modules) if layer is not None}
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
    modules = imported("mailpipe.enqueue")
    assert not [m for m in modules if m.split(".")[0] in CONVERTERS]
