"""`celery -A mailpipe flower` as the Procfile starts it (from the repository root, which holds
flowerconfig.py), on a Redis key prefix of its own, and read through its HTTP API."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import requests

from mailpipe.cli.demo.servers import free_port
from tests.support.paths import REPO
from tests.support.waits import wait_for


def flower_env(basic_auth: str | None) -> dict[str, str]:
    """Its own key prefix: Flower, its worker and its jobs see nothing else of the run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWER_", "MAILPIPE_FLOWER_"))}
    env["MAILPIPE_REDIS_PREFIX"] = f"{os.environ['MAILPIPE_REDIS_PREFIX']}f{uuid.uuid4().hex[:8]}:"
    if basic_auth:
        env["MAILPIPE_FLOWER_BASIC_AUTH"] = basic_auth
    return env


def flower_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "mailpipe", "flower", *args]


class Flower:
    def __init__(self, env: dict[str, str], log_path: Path, auth: tuple[str, str] | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.auth = auth
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                flower_command("--address=127.0.0.1", f"--port={self.port}"),
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.log_path = log_path

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("auth", self.auth)
        return requests.get(self.url + path, timeout=5, **kwargs)

    def wait_ready(self) -> None:
        def healthy() -> bool:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                return self.get("/healthcheck", auth=None).status_code == 200
            except requests.ConnectionError:
                return False

        wait_for(healthy, 30, "Flower to answer /healthcheck")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(15)
