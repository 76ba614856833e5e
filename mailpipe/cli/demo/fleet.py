"""Real `celery worker` and `celery beat` processes on this machine, started as subprocesses
exactly as an operator starts them: the demo's worker, and the tests' and benchmarks' fleets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CeleryProcess:
    role: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    nodename: str = ""
    cwd: Path | None = None  # where to start it: the checkout whose code `-A mailpipe` imports
    python: str = sys.executable  # the interpreter: another release's, in a venv of its own
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> CeleryProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [self.python, "-m", "celery", "-A", "mailpipe", self.role, *self.args],
            env=self.env,
            cwd=self.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # signals sent to the test or demo do not reach it
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the worker answers a ping; a beat only has to stay up."""
        app = control_app(self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.role} exited early; its log:\n{self.log_tail()}")
            if self.role != "worker":
                return
            if app.control.ping(destination=[self.nodename], timeout=0.5):
                return
        raise TimeoutError(f"{self.role} not ready after {timeout}s; its log:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole process group after `timeout`."""
        if self.process is None:
            return None
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the main process and its children, as a crashed container would go."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)

    def child_pids(self) -> list[int]:
        """PIDs of the prefork pool's children."""
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        try:
            return [int(pid) for pid in children.read_text().split()]
        except OSError:
            return []

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def control_app(env: dict[str, str]):
    """A bare Celery app on the broker and key prefix of `env`, to ping the process started
    with it (which may not be this process's own)."""
    from celery import Celery

    from mailpipe.settings import Settings

    app = Celery("mailpipe-control", set_as_current=False)
    app.conf.broker_url = env.get(
        "MAILPIPE_BROKER_URL", Settings.model_fields["broker_url"].default
    )
    app.conf.broker_transport_options = {"global_keyprefix": env.get("MAILPIPE_REDIS_PREFIX", "")}
    app.conf.accept_content = ["json"]
    return app


def worker(
    env: dict[str, str],
    log_dir: Path,
    *,
    concurrency: int = 2,
    name: str | None = None,
    pool: str = "prefork",
    extra_args: tuple[str, ...] = (),
) -> CeleryProcess:
    """A worker; `pool="threads"` with `-Q <queue>.model` in `extra_args` is the model role."""
    nodename = f"{name or 'worker-' + uuid.uuid4().hex[:8]}@localhost"
    return CeleryProcess(
        role="worker",
        args=[
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--hostname",
            nodename,
            "--loglevel",
            "INFO",
            "--without-mingle",
            "--without-gossip",
            *extra_args,
        ],
        env=env,
        log_path=log_dir / f"{nodename.split('@')[0]}.log",
        nodename=nodename,
    )


def beat(env: dict[str, str], log_dir: Path, name: str = "beat") -> CeleryProcess:
    return CeleryProcess(
        role="beat",
        args=["--loglevel", "INFO", "--schedule", str(log_dir / f"{name}-schedule")],
        env=env,
        log_path=log_dir / f"{name}.log",
    )
