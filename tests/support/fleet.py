"""Workers of a test's own, on their own Redis key prefix, with `tests.support.faults` loaded.

A test that kills, stops or starves workers starts its own here, so that it never takes the
session's shared worker with it, and talks to them from the test process.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from kombu.transport.redis import PRIORITY_STEPS, Channel
from redis import Redis

from mailpipe.broker import queues
from mailpipe.broker.layout import EMAIL_ID_HEADER
from mailpipe.broker.queues import job_queues
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.settings import Settings
from mailpipe.storage import flags
from tests.support.faults import countdowns_key, release, runs_key, set_fault, starts_key


def lists_of(prefix: str, queue: str, settings: Settings) -> list[str]:
    """The Redis lists kombu keeps a lane queue in under `prefix`: its own and its shards', one
    per priority step each."""
    return [
        name if step == 0 else f"{name}{Channel.sep}{step}"
        for member in queues.family(queue, settings)
        for name in [prefix + member]
        for step in PRIORITY_STEPS
    ]


def waiting_in(redis: Redis, prefix: str, queue: str, settings: Settings) -> int:
    """How many jobs wait in a lane queue and its shards under `prefix`."""
    return sum(redis.llen(name) for name in lists_of(prefix, queue, settings))


class Fleet:
    """Workers on their own key prefix, and what the test process needs to talk to them."""

    def __init__(self, res, tmp_path: Path, **settings: str) -> None:  # type: ignore[no-untyped-def]
        self.res = res
        self.tmp_path = tmp_path
        self.prefix = f"crash{uuid.uuid4().hex[:8]}:"
        self.env = dict(os.environ)
        self.env["MAILPIPE_REDIS_PREFIX"] = self.prefix
        self.env.update(settings)
        self.workers: list[localfleet.CeleryProcess] = []
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)

    def worker(self, name: str, *args: str, **env: str) -> localfleet.CeleryProcess:
        process = localfleet.worker(
            {**self.env, **env},
            self.tmp_path,
            name=name,
            extra_args=("-I", "tests.support.faults", *args),
        ).start()
        process.wait_ready()
        self.workers.append(process)
        return process

    def both_stages(self) -> None:
        """A CPU worker (its queue and the sweeps') and a model worker on threads (the model
        queue), as the worker and model roles run them."""
        queue = self.env.get("MAILPIPE_QUEUE", self.res.settings.queue)
        self.worker("cpu", "-Q", f"{queue},{queue}.control")
        self.worker("model", "-P", "threads", "-c", "8", "-Q", f"{queue}.model")

    def beat(self, name: str = "beat") -> localfleet.CeleryProcess:
        process = localfleet.beat(self.env, self.tmp_path, name=name).start()
        process.wait_ready()
        self.workers.append(process)
        return process

    def queue_depth(self, queue: str | None = None) -> int:
        """Jobs waiting in one of the fleet's queues, its email queue unless named."""
        return sum(self.res.redis.llen(name) for name in self._lists(queue or self._settings.queue))

    def jobs_in(self, queue: str) -> dict[int, str]:
        """The jobs waiting in one of the fleet's queues: each one's email, and the lane its
        message carries (None: no lane)."""
        return {
            email_id: kwargs.get("lane") for email_id, (_, kwargs) in self.placed(queue).items()
        }

    def placed(self, queue: str) -> dict[int, tuple[str, dict[str, object]]]:
        """The jobs waiting in one of the fleet's lane queues or its shards: each one's email,
        the queue it waits in, and its message's keywords."""
        jobs = {}
        for name in self._lists(queue):
            member = name.removeprefix(self.prefix).split(Channel.sep)[0]
            for raw in self.res.redis.lrange(name, 0, -1):
                message = json.loads(raw)
                _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
                jobs[message["headers"][EMAIL_ID_HEADER]] = (member, kwargs)
        return jobs

    def flush(self) -> None:
        """What a flushed Redis leaves the fleet: none of its keys, queue bindings included."""
        names = list(self.res.redis.scan_iter(match=f"{self.prefix}*", count=1000))
        if names:
            self.res.redis.delete(*names)

    def cli(self, *args: str) -> str:
        """`mailpipe ARGS` as an operator runs it, on the fleet's broker and key prefix."""
        done = subprocess.run(
            [sys.executable, "-m", "mailpipe.cli.main", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return done.stdout

    def consumed_queues(self, nodename: str) -> set[str]:
        """The queues the worker consumes now, as Celery's `active_queues` command answers."""
        with localfleet.control_app(self.env) as control:
            replies = control.control.inspect(destination=[nodename], timeout=2.0).active_queues()
        return {queue["name"] for queue in (replies or {}).get(nodename, [])}

    def unacked(self) -> int:
        """Messages delivered to the fleet's workers and not yet acknowledged."""
        return int(self.res.redis.hlen(f"{self.prefix}{Channel.unacked_key}"))

    def lose_jobs(self) -> None:
        """What a broker that lost its messages leaves (a Redis failover, a purge by hand): every
        job of the fleet, waiting or delivered, is gone; markers, leases and runs stay."""
        names = [name for queue in job_queues(self._settings) for name in self._lists(queue)]
        names += [
            f"{self.prefix}{Channel.unacked_key}",
            f"{self.prefix}{Channel.unacked_index_key}",
        ]
        self.res.redis.delete(*names)

    def sweep(self) -> dict[str, object]:
        """One sweep in the fleet's key space, with no grace for jobs just sent: a job the test
        lost is taken for lost at once. Its summary, with the emails it re-added."""
        script = (
            "import json; from mailpipe.enqueue import enqueue_emails; "
            "from mailpipe.operations import sweeper; from mailpipe.resources import get_resources; "
            "res = get_resources(); result = sweeper.sweep(res, in_flight_grace=0, "
            "enqueue=lambda ids, task, lane, boxes: enqueue_emails(ids, res, task, lane, boxes).sent); "
            "print(json.dumps({**result.summary(), 'readded_ids': result.readded_ids}))"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], env=self.env, check=True, capture_output=True, text=True
        )
        return json.loads(done.stdout.splitlines()[-1])

    @property
    def _settings(self) -> Settings:
        return self.res.settings.model_copy(
            update={"queue": self.env.get("MAILPIPE_QUEUE", self.res.settings.queue)}
        )

    def _lists(self, queue: str) -> list[str]:
        return lists_of(self.prefix, queue, self._settings)

    def set_fault(self, email_id: int, mode: str, times: int | None = None) -> None:
        set_fault(self.res.redis, email_id, mode, times, prefix=self.prefix)

    def release(self, email_id: int) -> None:
        release(self.res.redis, email_id, prefix=self.prefix)

    def runs(self, email_id: int) -> int:
        """Deliveries of the email's job that reached its steps."""
        return int(self.res.redis.get(runs_key(email_id, self.prefix)) or 0)

    def starts(self, email_id: int) -> list[float]:
        """When each of those deliveries reached the steps (unix time)."""
        return [float(t) for t in self.res.redis.lrange(starts_key(email_id, self.prefix), 0, -1)]

    def countdowns(self, email_id: int) -> list[float]:
        """The countdown of each retry the email's deliveries sent (seconds), in order."""
        return [
            float(c) for c in self.res.redis.lrange(countdowns_key(email_id, self.prefix), 0, -1)
        ]

    def enqueue(self, email_ids: list[int]) -> None:
        """The deduplicated enqueue, run in the fleet's key space."""
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from mailpipe.enqueue import enqueue_emails; "
                "enqueue_emails([int(a) for a in sys.argv[1:]])",
                *map(str, email_ids),
            ],
            env=self.env,
            check=True,
        )

    def send(self, email_id: int, **options: float) -> None:
        """One process_email message with its own options. It sets the dedup marker as an
        enqueue would, so that the sweep a worker runs at start does not add a second copy."""
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, sys; from mailpipe.coordination import redis_keys; "
                "from mailpipe.resources import get_resources; "
                "from mailpipe.app.tasks import process_email; email_id = int(sys.argv[1]); "
                "import time; get_resources().redis.set(redis_keys.job_marker(email_id), str(time.time()), ex=600); "
                "process_email.apply_async((email_id,), **json.loads(sys.argv[2]))",
                str(email_id),
                json.dumps(options),
            ],
            env=self.env,
            check=True,
        )

    def stop(self) -> None:
        """The test is over: SIGTERM, and SIGKILL for a worker still up after 10 s (a warm
        shutdown after hard time limits can hang; the shutdown tests assert shutdowns)."""
        for process in self.workers:
            process.stop(timeout=10)


def enqueue_in(env: dict[str, str], email_ids: list[int]) -> None:
    """Enqueue through the one deduplicated path, as upstream code would, on `env`'s broker."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from mailpipe.enqueue import enqueue_emails; "
            "enqueue_emails(int(i) for i in sys.argv[1:])",
            *map(str, email_ids),
        ],
        env=env,
        check=True,
    )
