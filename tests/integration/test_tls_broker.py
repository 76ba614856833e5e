"""A `rediss://` broker: a real worker runs a job over TLS, and the server's certificate is
verified (`broker_use_ssl`, mailpipe.app.config); kombu alone would not check it. This fails
if a `rediss://` broker is spoken to in plain text or without checking whom."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mailpipe.cli.demo.servers import PrivateRedis
from tests.support.probes import ask_a_job_process

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def _write_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA of the test's own, and a certificate for 127.0.0.1 that it signed."""
    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool):  # type: ignore[no-untyped-def]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    server_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("mailpipe test CA", ca_key, "mailpipe test CA", ca_key, ca=True)
    server = certificate("127.0.0.1", server_key, "mailpipe test CA", ca_key, ca=False)
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A redis-server of the test's own that speaks TLS only; its URL and the CA to trust."""
    ca, cert, key = _write_certificates(tmp_path)
    server = PrivateRedis(tmp_path / "redis.log", tls=(cert, key, ca)).start()
    try:
        yield server.url, ca
    finally:
        server.stop()


def test_a_worker_runs_a_job_over_a_tls_broker(tls_redis, res, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server_url, ca = tls_redis
    url = f"{server_url}?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    over_tls = redis.Redis.from_url(url)
    answer = ask_a_job_process(res, tmp_path, answers=over_tls, MAILPIPE_BROKER_URL=url)
    assert answer == "off"


def test_a_broker_whose_certificate_is_not_trusted_is_refused(tls_redis) -> None:  # type: ignore[no-untyped-def]
    server_url, _ = tls_redis
    connect = (
        "from mailpipe.celery import app\n"
        "app.connection_for_write().ensure_connection(max_retries=1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", connect],
        env={**os.environ, "MAILPIPE_BROKER_URL": server_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "CERTIFICATE_VERIFY_FAILED" in done.stderr, done.stderr[-2000:]
