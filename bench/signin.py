"""The console's sign-in under a flood of wrong passwords, and how long it takes to refuse a known
and an unknown user (docs/benchmarks.md, "Sign-in").

    .venv/bin/python -m bench.signin [--src CHECKOUT] [--json FILE]

Flood: `mailpipe web` (the checkout at `--src`, this one by default) with one operator whose
password is an argon2 hash (argon2-cffi's defaults: 64 MiB, 3 passes, 4 lanes) is sent `--wrong`
distinct wrong passwords for that operator, evenly over `--seconds`, by `--clients` threads from
`--sources` loopback client addresses in turn. Meanwhile the server's VmRSS is read every 10 ms
and /healthz asked every 20 ms on a connection of its own. Printed: the server's RSS at rest, its
peak (sampled, and the kernel's VmHWM), the worst /healthz, the answers' statuses.

Timing: another server with `--tries` operators sharing one bcrypt hash (`--bcrypt-rounds`);
each of them and as many unknown users are refused a wrong password once, in turn, each from a
client address of its own. Printed: the median time to refuse each kind.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import bcrypt
from argon2 import PasswordHasher

from bench import harness
from mailpipe.cli.demo.servers import free_port
from tests.support.signin import Watch, flood, get, median_ms, refusal_times, vm_kib
from tests.support.waits import wait_for


@contextmanager
def console(
    src: Path, operators: str, settings: Mapping[str, str] | None = None
) -> Iterator[tuple[str, int, IO[bytes]]]:
    """`mailpipe web` of the checkout at `src` with `operators` and `settings` on top of its
    defaults: its URL, pid and log."""
    port = free_port()
    env = harness.env_without_settings() | {
        "PYTHONPATH": str(src),
        "MAILPIPE_WEB_HOST": "127.0.0.1",
        "MAILPIPE_WEB_PORT": str(port),
        "MAILPIPE_WEB_OPERATORS": operators,
        **(settings or {}),
    }
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [*harness.mailpipe_command(src), "web"],
            env=env,
            cwd=src,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: _healthy(url, server, log), 60, "mailpipe web to answer")
            yield url, server.pid, log
        finally:
            server.terminate()
            server.wait(60)


def _healthy(url: str, server: subprocess.Popen[bytes], log: IO[bytes]) -> bool:
    if server.poll() is not None:
        log.seek(0)
        raise RuntimeError(f"mailpipe web exited:\n{log.read().decode(errors='replace')}")
    try:
        return get(url, "/healthz", timeout=5).status == 200
    except OSError:
        return False


def measure_flood(args: argparse.Namespace) -> dict[str, Any]:
    hashed = PasswordHasher().hash(secrets.token_urlsafe(16))
    with console(args.src, f"target:{hashed}") as (url, pid, _):
        time.sleep(1)  # the start's imports and allocations settled
        at_rest = vm_kib(pid, "VmRSS") / 1024
        started = time.perf_counter()
        with Watch(url, pid) as seen:
            statuses = flood(url, "target", args.wrong, args.seconds, args.clients, args.sources)
        took = time.perf_counter() - started
        hwm = vm_kib(pid, "VmHWM") / 1024
    return {
        "rss_at_rest_mib": at_rest,
        "rss_peak_sampled_mib": max(seen.rss_mib),
        "vm_hwm_mib": hwm,
        "healthz_worst_ms": seen.worst_healthz_s * 1000,
        "healthz_answers": len(seen.healthz_s),
        "healthz_refused": seen.healthz_refused,
        "statuses": {str(status): count for status, count in sorted(statuses.items())},
        "flood_s": took,
    }


def measure_timing(args: argparse.Namespace) -> dict[str, Any]:
    password = secrets.token_urlsafe(16).encode()
    hashed = bcrypt.hashpw(password, bcrypt.gensalt(rounds=args.bcrypt_rounds)).decode()
    known = [f"operator{number}" for number in range(args.tries)]
    unknown = [f"nobody{number}" for number in range(args.tries)]
    with console(args.src, ",".join(f"{user}:{hashed}" for user in known)) as (url, _, _):
        known_s, unknown_s = refusal_times(url, known, unknown, "a wrong password")
    return {
        "known_median_ms": median_ms(known_s),
        "unknown_median_ms": median_ms(unknown_s),
        "known_ms": [s * 1000 for s in known_s],
        "unknown_ms": [s * 1000 for s in unknown_s],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=harness.REPO)
    parser.add_argument("--wrong", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--sources", type=int, default=50)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--bcrypt-rounds", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.src = args.src.resolve()
    flooded = measure_flood(args)
    timed = measure_timing(args)
    f, t = flooded, timed
    print(f"code: {args.src} ({os.cpu_count()} CPUs)")
    print(
        f"flood: {args.wrong} wrong argon2 passwords over {args.seconds:g} s, {args.clients} "
        f"clients, {args.sources} addresses; took {f['flood_s']:.1f} s; statuses {f['statuses']}"
    )
    print(
        f"  RSS at rest {f['rss_at_rest_mib']:.0f} MiB, peak {f['rss_peak_sampled_mib']:.0f} MiB "
        f"sampled, VmHWM {f['vm_hwm_mib']:.0f} MiB"
    )
    print(
        f"  /healthz worst {f['healthz_worst_ms']:.0f} ms over {f['healthz_answers']} answers, "
        f"{len(f['healthz_refused'])} refused or failed"
    )
    print(
        f"refused a wrong password (bcrypt, {args.bcrypt_rounds} rounds, median of {args.tries}): "
        f"known user {t['known_median_ms']:.1f} ms, unknown user {t['unknown_median_ms']:.1f} ms"
    )
    if args.json:
        harness.write_report(args.json, args, {"flood": flooded, "timing": timed})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
