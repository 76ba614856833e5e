"""Searches against subjects an outsider crafted, on a large database: one search alone, eight at
once with the overview's latency meanwhile, and ordinary searches; this checkout and a baseline
checkout in turns (docs/benchmarks.md, "Search under a flood").

    .venv/bin/python -m bench.search_flood --baseline-src /tmp/mailpipe-search-baseline \
        [--emails 1000000] [--crafted 20000] [--repeat 3] [--json FILE]

Seeds one database: `--emails` ordinary emails as `bench.console.prepare_search` seeds them (a
month of mail: people, newsletters, billing; subjects of five words from 2,000), then
`--crafted` more, the newest, from one outsider's addresses, each with the subject
`'x ' + '!' * 997` and a succeeded run; `VACUUM ANALYZE`. Then, per repetition, `mailpipe web`
of each checkout (its own command, `harness.mailpipe_command`) on the database, with its default
settings and users of the benchmark's own, and over HTTP on loopback, as `GET /api/search`:

- on each server in turn (each repetition starts with the other one): one crafted search
  (`subject=` `'!' * 498 + 'x'`, whose full text is the word `x`) alone; then eight at once,
  each by a user of its own, while another user requests the overview (`/`) again and again on
  a keep-alive connection, from before the eight start until the last one has answered: each
  search's status and time, the overview's statuses and p50 and p99;
- each ordinary search (ORDINARY) `--ordinary-repeat` times on both servers, request by
  request in turns, after a warm-up round: the median.

A request waits at most `--timeout` seconds. Prints the medians over the repetitions per
checkout and their ratios, and how many of the server's log lines name the pool's or the
statement's timeout.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import requests

from bench import harness
from bench.console import prepare_search, search_cases
from bench.signin import console
from bench.sweep import resources_on
from tests.support.services import delete_prefix
from tests.support.waits import wait_for

DB_NAME = "mailpipe_bench_search_flood"
CRAFTED_SUBJECT = "x " + "!" * 997
CRAFTED_QUERY = {"subject": "!" * 498 + "x"}
AT_ONCE = 8
# The crafted emails, newest of all, from one outsider's domain, each with a succeeded run.
CRAFTED_SEED = [
    "SET session_replication_role = replica",
    "INSERT INTO email_message (blob_key, size, sha256, received_at, created_at, "
    "needs_review, has_run, subject, sender, lane) SELECT 'raw/crafted/' || g, 1000, "
    "md5('crafted' || g), now(), now(), false, true, %(subject)s, "
    "'Outsider <o' || g || '@outsider.example>', 'live' FROM generate_series(1, %(n)s) g",
    "INSERT INTO pipeline_run (email_id, status, attempts, sweep_count, created_at, updated_at, "
    "closed_at, converted_at) SELECT id, 'succeeded', 1, 0, now(), now(), now(), now() "
    "FROM email_message WHERE blob_key LIKE 'raw/crafted/%%'",
    "SET session_replication_role = DEFAULT",
]
# Server log lines that say a request waited out the pool or the statement timeout.
TIMEOUTS = ("QueuePool limit", "statement timeout")


# The typical searches of the sender and the subject that docs/benchmarks.md, "Search", times
# (`bench.console.search_cases`): the crafted emails are the newest, so that a walk from the
# newest reads them first.
ORDINARY = (
    "sender (",  # a person's address, the one named
    "sender, a newsletter",
    "sender, a domain",
    "subject, the commonest word",
    "subject, a word of 0.8 %",
    "subject, a rare word",
    "subject, two words",
    "subject of 0.8 % + state",
    "subject of 0.8 % + label",
)


def ordinary(url: str) -> dict[str, dict[str, str]]:
    """ORDINARY's values on the database at `url`, by name."""
    res = resources_on(url)
    try:
        alone, together = search_cases(res)
    finally:
        res.close()
    cases = {**alone, **together}
    return {name: cases[name] for wanted in ORDINARY for name in cases if name.startswith(wanted)}


def prepare(emails: int, crafted: int) -> str:
    import psycopg

    url = prepare_search(DB_NAME, emails)
    with psycopg.connect(url) as conn:
        for statement in CRAFTED_SEED:
            conn.execute(statement, {"subject": CRAFTED_SUBJECT, "n": crafted})
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return url


def timed_get(
    session: requests.Session, url: str, auth: tuple[str, str], timeout: float, **params: str
) -> tuple[int, float]:
    """One GET's status (0: no answer within `timeout`) and seconds."""
    started = time.perf_counter()
    try:
        status = session.get(url, params=params, auth=auth, timeout=timeout).status_code
    except requests.RequestException:
        status = 0
    return status, time.perf_counter() - started


def repetition(
    checkouts: dict[str, Path],
    url: str,
    order: list[str],
    searches: dict[str, dict[str, str]],
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Each checkout's server started, the flood on each in `order`, then the ordinary
    `searches` on both, request by request in turns."""
    users = {f"bench{n}": secrets.token_hex(8) for n in range(AT_ONCE + 1)}
    operators = ",".join(f"{user}:{password}" for user, password in users.items())
    settings = {
        "MAILPIPE_DATABASE_URL": url,
        "MAILPIPE_BROKER_URL": harness.REDIS_URL,
        "MAILPIPE_REDIS_PREFIX": os.environ["MAILPIPE_REDIS_PREFIX"],
    }
    with ExitStack() as servers:
        started = {
            name: servers.enter_context(console(src, operators, settings))
            for name, src in checkouts.items()
        }
        taken = {name: flood(started[name][0], users, args) for name in order}
        bases = {name: base for name, (base, _, _) in started.items()}
        for name, times in ordinary_in_turns(bases, users, searches, args).items():
            taken[name]["ordinary_ms"] = times
        for name, (_, _, log) in started.items():
            log.seek(0)
            lines = log.read().decode(errors="replace").splitlines()
            taken[name]["log_timeouts"] = {k: sum(k in line for line in lines) for k in TIMEOUTS}
    return taken


def flood(base: str, users: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One crafted search alone, then AT_ONCE at once while the overview is asked again and
    again."""
    searchers = list(users.items())[:AT_ONCE]
    watcher = list(users.items())[AT_ONCE]
    search = f"{base}/api/search"
    with requests.Session() as session:
        for user in [watcher, *searchers]:  # each signs in once
            assert timed_get(session, f"{base}/", user, args.timeout)[0] == 200
        one = timed_get(session, search, searchers[0], args.timeout, **CRAFTED_QUERY)

    overview: list[tuple[int, float]] = []
    done = threading.Event()

    def watch() -> None:
        with requests.Session() as own:
            while not done.is_set():
                overview.append(timed_get(own, f"{base}/", watcher, args.timeout))

    def crafted(user: tuple[str, str]) -> tuple[int, float]:
        with requests.Session() as own:
            return timed_get(own, search, user, args.timeout, **CRAFTED_QUERY)

    with ThreadPoolExecutor(AT_ONCE + 1) as threads:
        watching = threads.submit(watch)
        wait_for(lambda: len(overview) >= 3, args.timeout * 3, "the overview to answer")
        at_once = list(threads.map(crafted, searchers))
        done.set()
        watching.result()
    return {"one": one, "at_once": at_once, "overview": overview}


def ordinary_in_turns(
    bases: dict[str, str],
    users: dict[str, str],
    searches: dict[str, dict[str, str]],
    args: argparse.Namespace,
) -> dict[str, dict[str, float]]:
    """Each of `searches` on each server, request by request in turns (the first round a
    warm-up): the median ms per server and search."""
    user = next(iter(users.items()))
    taken: dict[str, dict[str, list[float]]] = {n: {s: [] for s in searches} for n in bases}
    with requests.Session() as session:
        for round_ in range(1 + args.ordinary_repeat):
            for search, values in searches.items():
                for name in harness.rotated(list(bases), round_):
                    status, took = timed_get(
                        session, f"{bases[name]}/api/search", user, args.timeout, **values
                    )
                    if status != 200:
                        raise RuntimeError(f"{name}: {search} answered {status}")
                    if round_:
                        taken[name][search].append(took)
    return {
        name: {search: statistics.median(t) * 1000 for search, t in times.items()}
        for name, times in taken.items()
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over the repetitions of one checkout."""
    overview = [(status, s) for run in runs for status, s in run["overview"]]
    return {
        "one_s": statistics.median(run["one"][1] for run in runs),
        "one_statuses": dict(Counter(run["one"][0] for run in runs)),
        "at_once_median_s": statistics.median(s for run in runs for _, s in run["at_once"]),
        "at_once_max_s": statistics.median(max(s for _, s in run["at_once"]) for run in runs),
        "at_once_statuses": dict(Counter(status for run in runs for status, _ in run["at_once"])),
        "overview_p50_ms": statistics.median(s for _, s in overview) * 1000,
        "overview_p99_ms": harness.percentile((s for _, s in overview), 0.99) * 1000,
        "overview_statuses": dict(Counter(status for status, _ in overview)),
        "ordinary_ms": {
            name: statistics.median(run["ordinary_ms"][name] for run in runs)
            for name in runs[0]["ordinary_ms"]
        },
        "log_timeouts": {k: sum(run["log_timeouts"][k] for run in runs) for k in TIMEOUTS},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--src", type=Path, default=harness.REPO)
    parser.add_argument("--emails", type=int, default=1_000_000)
    parser.add_argument("--crafted", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ordinary-repeat", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["MAILPIPE_REDIS_PREFIX"] = f"benchflood{uuid.uuid4().hex[:8]}:"
    checkouts = {"baseline": args.baseline_src.resolve(), "this": args.src.resolve()}
    started = time.perf_counter()
    url = prepare(args.emails, args.crafted)
    seeded_s = time.perf_counter() - started
    searches = ordinary(url)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    try:
        for number in range(args.repeat):
            order = harness.rotated(list(checkouts), number)
            for name, taken in repetition(checkouts, url, order, searches, args).items():
                runs[name].append(taken)
    finally:
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(DB_NAME).drop()
    results = {name: summary(taken) for name, taken in runs.items()}
    before, after = results["baseline"], results["this"]
    print(
        f"{args.emails:,} ordinary emails and {args.crafted:,} crafted, seeded in {seeded_s:.0f} s;"
        f" medians of {args.repeat} repetitions; load average at the end {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':>36} {'baseline':>12} {'this':>12} {'this/base':>10}")
    rows = [
        ("one crafted search (s)", "one_s"),
        (f"{AT_ONCE} at once, each: median (s)", "at_once_median_s"),
        (f"{AT_ONCE} at once, the slowest (s)", "at_once_max_s"),
        ("overview meanwhile, p50 (ms)", "overview_p50_ms"),
        ("overview meanwhile, p99 (ms)", "overview_p99_ms"),
    ]
    for title, key in rows:
        print(
            f"{title:>36} {before[key]:>12.2f} {after[key]:>12.2f} {after[key] / before[key]:>10.3f}"
        )
    for key in ("one_statuses", "at_once_statuses", "overview_statuses", "log_timeouts"):
        print(f"{key:>36} baseline {before[key]}, this {after[key]}")
    print(f"{'ordinary search, median (ms)':>36}")
    for name, ms in before["ordinary_ms"].items():
        mine = after["ordinary_ms"][name]
        print(f"{name:>36} {ms:>12.2f} {mine:>12.2f} {mine / ms:>10.3f}")
    if args.json:
        harness.write_report(args.json, args, {"runs": runs, "summary": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
