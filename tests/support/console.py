"""`mailpipe web` as a process of the test's own, on a free loopback port, with users whose
passwords are plain, bcrypt and argon2 hashes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import bcrypt
import requests
from argon2 import PasswordHasher

from mailpipe.cli.demo.servers import free_port
from tests.support.waits import wait_for

BIN = Path(sys.executable).parent

# name: (password, how MAILPIPE_WEB_* holds it)
OPERATOR = ("ops", "ops-password")
OPERATOR_ARGON2 = ("ops2", "second-operator-password")
VIEWER = ("viewer", "viewer-password")


def users_env() -> dict[str, str]:
    """Two operators (plain, argon2) and a viewer (bcrypt), as the role reads them."""
    argon2 = PasswordHasher().hash(OPERATOR_ARGON2[1])
    hashed = bcrypt.hashpw(VIEWER[1].encode(), bcrypt.gensalt(rounds=4)).decode()
    return {
        "MAILPIPE_WEB_OPERATORS": f"{OPERATOR[0]}:{OPERATOR[1]},{OPERATOR_ARGON2[0]}:{argon2}",
        "MAILPIPE_WEB_VIEWERS": f"{VIEWER[0]}:{hashed}",
    }


class ConsoleProcess:
    """`mailpipe web` started with `env` and a port of its own, its output in a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {
            **env,
            "PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            "MAILPIPE_WEB_PORT": str(self.port),
        }
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [str(BIN / "mailpipe"), "web"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self.healthy, 30, f"the console to answer /healthz:\n{self.output()}")

    def healthy(self) -> bool:
        assert self.process.poll() is None, f"mailpipe web exited:\n{self.output()}"
        try:
            return requests.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def csrf(self, auth: tuple[str, str]) -> str:
        """The token in the failed list's form, as `auth`'s user sees it."""
        page = requests.get(f"{self.url}/failed", auth=auth, timeout=10)
        assert page.status_code == 200, page.text
        found = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert found, "no CSRF token in the failed list"
        return found[1]

    def stop(self) -> None:
        """SIGTERM, as ECS and a Procfile runner stop it: uvicorn finishes the requests under
        way, then ends by the signal it caught, as its parent expects."""
        assert self.process.poll() is None, f"mailpipe web exited early:\n{self.output()}"
        os.killpg(self.process.pid, signal.SIGTERM)
        code = self.process.wait(30)
        assert code == -signal.SIGTERM, f"exit code {code}:\n{self.output()[-3000:]}"
        assert "Application shutdown complete" in self.output()
