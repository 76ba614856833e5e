"""The app's broker connection (mailpipe.app.config): kombu's own Redis transport, the URL's
scheme kept (Flower reads it to pick its broker view), and a `rediss://` URL gets TLS with the
server's certificate verified unless the URL's query says otherwise. Each case in a fresh
interpreter as far as mailpipe goes (`tests.support.forked`), since the configuration is read
from the environment once."""

from __future__ import annotations

import json

import pytest

from tests.support.forked import run_forked

_CONNECTION_OF_THE_APP = """
import json
from mailpipe.celery import app
connection = app.connection_for_write()  # lazy: nothing is connected
ssl = connection.ssl
print(json.dumps({
    "transport": type(connection.transport).__module__,
    "scheme": connection.as_uri().split(":")[0],
    "ssl": {key: int(value) for key, value in ssl.items()} if ssl else ssl,
}))
"""


CASES = {
    "rediss://:secret@broker.example:6380/0": {"ssl_cert_reqs": 2},  # CERT_REQUIRED
    "rediss://:secret@broker.example:6380/0?ssl_cert_reqs=none": {"ssl_cert_reqs": 0},
    "redis://broker.example:6379/0": None,
}


@pytest.fixture(scope="module")
def connections() -> dict[str, str]:
    """What the app's connection was for each broker URL: each case in a child of one
    interpreter that imported Celery and kombu first."""
    cases = [(_CONNECTION_OF_THE_APP, {"MAILPIPE_BROKER_URL": url}) for url in CASES]
    return dict(zip(CASES, run_forked(cases, preload=("celery.app", "kombu")), strict=True))


@pytest.mark.parametrize(("url", "expected_ssl"), CASES.items())
def test_a_rediss_url_gets_tls_with_the_certificate_verified(
    url: str, expected_ssl: object, connections: dict[str, str]
) -> None:
    found = json.loads(connections[url].strip().splitlines()[-1])
    assert found == {
        "transport": "kombu.transport.redis",
        "scheme": url.split(":")[0],
        "ssl": expected_ssl,
    }
