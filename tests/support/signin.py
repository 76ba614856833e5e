"""Sign-ins at a running `mailpipe web` from many client addresses, and what its process does
meanwhile: its resident memory and how long `/healthz` takes. Shared by
tests/integration/test_signin.py and bench/signin.py.

Every address of 127.0.0.0/8 is the loopback on Linux, so a client that binds its end of the
connection to 127.0.x.y is, to the server, a client of its own: a flood from many addresses
without a network.
"""

from __future__ import annotations

import base64
import http.client
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Answer:
    status: int
    seconds: float
    headers: dict[str, str]
    body: str


def get(
    url: str,
    path: str,
    auth: tuple[str, str] | None = None,
    address: str = "127.0.0.1",
    timeout: float = 120.0,
) -> Answer:
    """GET `path` on a connection of its own from the client address `address`; `seconds` from
    before the connection to the end of the answer."""
    where = urlsplit(url)
    assert where.hostname is not None and where.port is not None
    headers = {}
    if auth is not None:
        pair = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        headers["Authorization"] = f"Basic {pair}"
    started = time.perf_counter()
    conn = http.client.HTTPConnection(
        where.hostname, where.port, timeout=timeout, source_address=(address, 0)
    )
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        body = response.read().decode(errors="replace")
    finally:
        conn.close()
    seconds = time.perf_counter() - started
    return Answer(response.status, seconds, {k.lower(): v for k, v in response.getheaders()}, body)


def addresses(count: int) -> Iterator[str]:
    """`count` loopback client addresses other than 127.0.0.1, from 127.0.1.1 on."""
    for number in range(count):
        yield f"127.0.{1 + number // 250}.{1 + number % 250}"


def vm_kib(pid: int, name: str) -> int:
    """A field of /proc/<pid>/status in KiB: VmRSS (resident now), VmHWM (the peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise LookupError(f"no {name} in /proc/{pid}/status")


@dataclass
class Watched:
    """What a `Watch` saw: the server's resident memory and its /healthz answers."""

    rss_mib: list[float] = field(default_factory=list)
    healthz_s: list[float] = field(default_factory=list)
    healthz_refused: list[str] = field(default_factory=list)

    @property
    def worst_healthz_s(self) -> float:
        return max(self.healthz_s, default=0.0)


class Watch:
    """While open: the server's VmRSS read every 10 ms, and /healthz asked every 20 ms on a
    connection of its own, as a load balancer's health check asks it."""

    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.pid = pid
        self.seen = Watched()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._memory, daemon=True),
            threading.Thread(target=self._healthz, daemon=True),
        ]

    def __enter__(self) -> Watched:
        for thread in self._threads:
            thread.start()
        return self.seen

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(150)

    def _memory(self) -> None:
        while not self._stop.wait(0.01):
            self.seen.rss_mib.append(vm_kib(self.pid, "VmRSS") / 1024)

    def _healthz(self) -> None:
        while not self._stop.wait(0.02):
            try:
                answer = get(self.url, "/healthz")
            except OSError as exc:
                self.seen.healthz_refused.append(repr(exc))
                continue
            self.seen.healthz_s.append(answer.seconds)
            if answer.status != 200:
                self.seen.healthz_refused.append(f"{answer.status} {answer.body.strip()}")


def flood(
    url: str, user: str, count: int, seconds: float, clients: int, sources: int
) -> Counter[int]:
    """`count` distinct wrong passwords for `user`, sent evenly over `seconds` by `clients`
    threads from `sources` client addresses in turn; the answers' statuses counted."""
    sent_from = list(addresses(sources))
    started = time.perf_counter()

    def one(number: int) -> int:
        time.sleep(max(0.0, started + number * seconds / count - time.perf_counter()))
        wrong = (user, f"wrong-{number}")
        return get(url, "/", auth=wrong, address=sent_from[number % sources]).status

    with ThreadPoolExecutor(clients) as pool:
        return Counter(pool.map(one, range(count)))


def refusal_times(
    url: str, known: list[str], unknown: list[str], password: str
) -> tuple[list[float], list[float]]:
    """How long each of `known` and of `unknown` takes to be refused `password`, each from an
    address of its own, the two kinds in turn (so that a drift of the machine's speed is shared)."""
    sent_from = addresses(len(known) + len(unknown))
    known_s: list[float] = []
    unknown_s: list[float] = []
    for named, unnamed in zip(known, unknown, strict=True):
        for user, times in ((named, known_s), (unnamed, unknown_s)):
            answer = get(url, "/", auth=(user, password), address=next(sent_from))
            assert answer.status == 401, (user, answer.status, answer.body)
            times.append(answer.seconds)
    return known_s, unknown_s


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000
