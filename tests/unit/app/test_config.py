"""The app's broker connection (mailpipe.app.config): kombu's own Redis transport, the URL's
scheme kept (Flower reads it to pick its broker view), and a `rediss://` URL gets TLS with the
server's certificate verified unless the URL's query says otherwise. Each case in a fresh
interpreter, since the configuration is read from the environment once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize(
    ("url", "expected_ssl"),
    [
        ("rediss://:secret@broker.example:6380/0", {"ssl_cert_reqs": 2}),  # CERT_REQUIRED
        ("rediss://:secret@broker.example:6380/0?ssl_cert_reqs=none", {"ssl_cert_reqs": 0}),
        ("redis://broker.example:6379/0", None),
    ],
)
def test_a_rediss_url_gets_tls_with_the_certificate_verified(
    url: str, expected_ssl: object
) -> None:
    env = {**os.environ, "MAILPIPE_BROKER_URL": url}
    done = subprocess.run(
        [sys.executable, "-c", _CONNECTION_OF_THE_APP],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "transport": "kombu.transport.redis",
        "scheme": url.split(":")[0],
        "ssl": expected_ssl,
    }
