"""A mutation check: deliberate faults in the code that keeps every email processed once, and
whether the tests catch each of them.

    .venv/bin/python -m tests.mutants.run [--only NAME ...] [--named-tests] [--json FILE]

Each mutant below is a one-line change a real bug could make in the code that keeps every email
processed once, in its lane and in its turn (docs/mutants.md lists the modules).
For each, the checkout (the package and the tests) is copied into a temporary folder, the change
is made there, and the tests that cover those modules run against the copy (real PostgreSQL,
Redis and worker processes, as always). A mutant is killed only when a test ran and failed on an
assertion (with `killed_by`, one of the tests it names); one that survives is a fault the tests
would let through. Anything else is no verdict and says so: a collection error, a test that does
not exist, services that are down, a run cut off by its timeout. The results are in
docs/mutants.md.

The suite runs a sample of five mutants a commit, each against only the tests that kill it
fastest (`killed_by`), in tests/test_mutants.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JOB = "tests/unit/pipeline/test_job.py"
LEASES = "tests/unit/coordination/test_leases.py"
ENQUEUE = "tests/unit/coordination/test_enqueue.py"
SWEEPER = "tests/integration/test_sweeper.py"
LANE_ORDER = "tests/unit/broker/test_lane_order.py"
RATE_LANES = "tests/unit/coordination/test_ratelimit_lanes.py"
PAUSES = "tests/unit/coordination/test_pauses.py"
ACTIONS = "tests/unit/operations/test_actions.py"
STATUS = "tests/unit/operations/test_status.py"
METRICS = "tests/unit/operations/test_metrics.py"
LANES = "tests/integration/test_lanes.py"

# The tests that cover the modules under mutation.
TESTS = [
    JOB,
    "tests/unit/coordination",
    SWEEPER,
    "tests/integration/test_idempotency.py",
    "tests/integration/test_recovery.py",
    "tests/integration/test_crashes.py",
    "tests/unit/broker",
    "tests/unit/operations",
    LANES,
]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    why: str  # the bug it stands for
    # The tests that kill it fastest: what the suite runs when a commit samples it
    # (tests/test_mutants.py).
    killed_by: tuple[str, ...]


MUTANTS = [
    Mutant(
        "claim-runs-closed",
        "mailpipe/pipeline/runs.py",
        "    if run.status is not RunStatus.OPEN:\n        return Refused(Refusal.CLOSED)",
        "    if False:\n        return Refused(Refusal.CLOSED)",
        "a closed run is run again",
        (f"{JOB}::test_model_calls_off_leaves_the_run_open_after_the_documents",),
    ),
    Mutant(
        "claim-counts-nothing",
        "mailpipe/pipeline/runs.py",
        "    run.attempts += 1\n",
        "    run.attempts += 0\n",
        "an attempt after a shutdown's cut-off is not counted, so a job cut off every time runs for ever",
        (f"{JOB}::test_a_shutdown_cut_off_gives_its_attempt_back_until_the_bound",),
    ),
    Mutant(
        "claim-one-attempt-more",
        "mailpipe/pipeline/policy.py",
        "    if attempts < limits.max_attempts:\n        return None\n",
        "    if attempts <= limits.max_attempts:\n        return None\n",
        "a fifth attempt",
        (f"{JOB}::test_a_run_at_a_lowered_attempt_limit_fails_without_another_attempt",),
    ),
    Mutant(
        "claim-forgets-the-dead-attempt",
        "mailpipe/pipeline/runs.py",
        "    _fail(run, failure.error, failure.error_class)\n",
        "    _fail(run, run.error or failure.error, failure.error_class)\n",
        "the death of an attempt is not recorded when an earlier error is",
        (f"{JOB}::test_a_death_after_a_transient_error_is_recorded_as_the_death",),
    ),
    Mutant(
        "cut-off-never-fails",
        "mailpipe/pipeline/policy.py",
        "    elif attempts >= limits.max_attempts:\n",
        "    elif cut_off is None and attempts >= limits.max_attempts:\n",
        "a job cut off by the hard time limit retries for ever",
        (
            f"{JOB}::test_an_attempt_cut_off_by_the_hard_time_limit_waits_its_backoff_then_the_last_fails",
        ),
    ),
    Mutant(
        "fence-ignores-claim",
        "mailpipe/pipeline/runs.py",
        "    if run.claims != token:\n        raise Superseded",
        "    if False:\n        raise Superseded",
        "a delivery whose claim was superseded still writes",
        (
            f"{JOB}::test_a_superseded_delivery_writes_nothing_while_the_new_holder_still_runs[with-attachments]",
        ),
    ),
    Mutant(
        "fence-ignores-status",
        "mailpipe/pipeline/runs.py",
        "    if run.status is not RunStatus.OPEN:\n        raise Superseded",
        "    if False:\n        raise Superseded",
        "a late delivery writes to a closed run",
        (f"{JOB}::test_a_delivery_whose_run_was_failed_meanwhile_writes_nothing",),
    ),
    Mutant(
        "one-statement-claim-counts-nothing",
        "mailpipe/pipeline/runs.py",
        '    "attempts": _RUN.c.attempts + 1,\n',
        '    "attempts": _RUN.c.attempts + 0,\n',
        "the usual claim does not count its attempt, so a crashing job runs for ever",
        (f"{JOB}::test_a_run_at_a_lowered_attempt_limit_fails_without_another_attempt",),
    ),
    Mutant(
        "one-statement-claim-one-attempt-more",
        "mailpipe/pipeline/runs.py",
        '        _RUN.c.attempts < bindparam("max_attempts"),\n',
        '        _RUN.c.attempts <= bindparam("max_attempts"),\n',
        "the usual claim lets a fifth attempt run",
        (f"{JOB}::test_a_run_at_a_lowered_attempt_limit_fails_without_another_attempt",),
    ),
    Mutant(
        "one-statement-claim-ignores-dead-attempt",
        "mailpipe/pipeline/runs.py",
        "        _RUN.c.attempt_started_at.is_(None),\n",
        "",
        "an attempt whose process died is never recorded as such",
        (f"{JOB}::test_the_next_attempt_runs_with_the_death_of_the_last_on_record",),
    ),
    Mutant(
        "close-ignores-attempt",
        "mailpipe/pipeline/runs.py",
        '    _RUN.c.claims == bindparam("fence_token"),\n',
        "",
        "a delivery whose attempt was superseded still closes the run with its writes",
        (f"{JOB}::test_a_stale_delivery_cannot_pass_for_a_later_claim",),
    ),
    Mutant(
        "give-back-keeps-attempt",
        "mailpipe/pipeline/runs.py",
        "    run.attempts = max(0, run.attempts - 1)\n    run.attempt_started_at = None\n",
        "    run.attempts = run.attempts\n    run.attempt_started_at = None\n",
        "a delivery that met an outage uses an attempt",
        (
            "tests/unit/pipeline/test_health.py::"
            "test_an_outage_uses_no_attempt_waits_past_any_bound_and_pauses_the_stage",
        ),
    ),
    Mutant(
        "handover-resets-sweeps",
        "mailpipe/pipeline/runs.py",
        '        "converted_at": now,\n        "attempts": 0,\n',
        '        "converted_at": now,\n        "attempts": 0,\n        "sweep_count": 0,\n',
        "a run's sweeps start again at its model stage: more than 3 sweeps per run",
        (f"{JOB}::test_a_run_left_waiting_keeps_its_sweeps_for_the_next_stage",),
    ),
    Mutant(
        "transient-one-attempt-more",
        "mailpipe/pipeline/policy.py",
        "    if attempts >= limits.max_attempts:\n        failure",
        "    if attempts > limits.max_attempts:\n        failure",
        "a fifth attempt after transient errors",
        (f"{JOB}::test_transient_errors_retry_with_backoff_then_fail_after_max_attempts",),
    ),
    Mutant(
        "reopen-keeps-answer",
        "mailpipe/pipeline/interventions.py",
        "    run.classified_at = None\n",
        "",
        "a reopened run never asks the model again",
        (f"{JOB}::test_a_reopened_run_asks_the_model_again",),
    ),
    Mutant(
        "release-drops-others-marker",
        "mailpipe/coordination/leases.py",
        "if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end",
        "if redis.call('get', KEYS[1]) ~= ARGV[1] then redis.call('del', KEYS[2]) return 0 end",
        "a delivery that lost its lease deletes the holder's marker",
        (
            f"{JOB}::test_a_delivery_that_lost_its_lease_writes_nothing_and_leaves_the_holder_s_marker",
        ),
    ),
    Mutant(
        "release-ignores-follow-up",
        "mailpipe/coordination/leases.py",
        "if ARGV[2] == '1' then",
        "if false then",
        "a retry's marker is deleted, so the email can be sent twice",
        (f"{LEASES}::test_release_before_a_follow_up_keeps_the_marker_stamped_anew",),
    ),
    Mutant(
        "no-takeover-of-dead",
        "mailpipe/coordination/leases.py",
        "holder and _holder_is_dead(holder) and self._take_over(holder)",
        "holder and False and self._take_over(holder)",
        "a dead child's lease is waited out",
        (f"{LEASES}::test_the_lease_of_a_dead_process_on_this_host_is_taken_over_at_once",),
    ),
    Mutant(
        "renewal-never-lost",
        "mailpipe/coordination/leases.py",
        "            self.lost = True\n",
        "            self.lost = False\n",
        "a lease taken by another goes unnoticed",
        (
            f"{LEASES}::test_a_renewal_that_finds_the_lease_taken_marks_it_lost_and_release_leaves_the_new_holder",
        ),
    ),
    Mutant(
        "renew-too-late",
        "mailpipe/coordination/leases.py",
        "                    lease.renew_at = now + lease.ttl_ms / 3000",
        "                    lease.renew_at = now + lease.ttl_ms / 900",
        "renewals come after the lease lapsed",
        (f"{LEASES}::test_a_held_lease_outlives_its_ttl_while_it_is_renewed",),
    ),
    Mutant(
        "marker-not-exclusive",
        "mailpipe/coordination/markers.py",
        "now, nx=True, ex=ttl)",
        "now, nx=False, ex=ttl)",
        "enqueue sends a second job for an email already queued",
        (f"{SWEEPER}::test_broker_flush_loses_jobs_and_one_sweep_readds_each_once",),
    ),
    Mutant(
        "marker-kept-after-failed-send",
        "mailpipe/enqueue.py",
        "        markers.release(res.redis, sent)\n",
        "",
        "a job that was never sent stays marked as queued",
        (
            f"{ENQUEUE}::test_a_batch_the_broker_drops_midway_leaves_no_marker_and_can_be_sent_again",
        ),
    ),
    Mutant(
        "refresh-does-nothing",
        "mailpipe/coordination/markers.py",
        "        redis.eval(_REFRESH, len(keys), *keys, stamp(), ttl)",
        "        pass",
        "waiting jobs lose their markers",
        (f"{SWEEPER}::test_waiting_jobs_whose_markers_are_gone_are_never_readded",),
    ),
    Mutant(
        "sweeper-blind-to-broker",
        "mailpipe/operations/sweeper.py",
        "        present = [i for i in email_ids if i in self._present]",
        "        present: list[int] = []",
        "waiting jobs are taken for lost",
        (f"{SWEEPER}::test_waiting_jobs_whose_markers_are_gone_are_never_readded",),
    ),
    Mutant(
        "sweeper-ignores-fresh-markers",
        "mailpipe/operations/sweeper.py",
        "            if running or (stamp is not None and markers.set_at(stamp) > recent):",
        "            if running:",
        "a job sent during the broker read is taken for lost",
        (f"{SWEEPER}::test_a_purged_queue_is_readded_at_the_next_sweep_though_its_markers_live",),
    ),
    Mutant(
        "sweeper-ignores-leases",
        "mailpipe/operations/sweeper.py",
        "            if running or (stamp",
        "            if False or (stamp",
        "a running job is taken for lost",
        (f"{SWEEPER}::test_a_running_job_is_never_taken_for_lost",),
    ),
    Mutant(
        "sweeper-one-sweep-more",
        "mailpipe/operations/sweeper.py",
        "sweeps[i] >= settings.max_sweeps]",
        "sweeps[i] > settings.max_sweeps]",
        "a stalled run is re-added a fourth time",
        (f"{SWEEPER}::test_a_run_whose_job_is_lost_three_times_is_taken_off_the_queue",),
    ),
    Mutant(
        "sweeper-counts-nothing",
        "mailpipe/pipeline/interventions.py",
        "sweep_count=PipelineRun.sweep_count + 1",
        "sweep_count=PipelineRun.sweep_count",
        "a stalled run is re-added for ever",
        (f"{SWEEPER}::test_a_run_whose_job_is_lost_three_times_is_taken_off_the_queue",),
    ),
    Mutant(
        "sweeper-model-rule-inverted",
        "mailpipe/operations/sweeper.py",
        "        stalled = not_(answered_lately)",
        "        stalled = answered_lately",
        "open runs are re-added only when they should wait",
        (f"{SWEEPER}::test_open_runs_follow_the_model_call_rules",),
    ),
    Mutant(
        "sweeper-no-reread",
        "mailpipe/operations/sweeper.py",
        "            view.take()\n            with res.db.session() as session:\n                rows = read(session, last_id)",
        "            view.take()",
        "a job that ended during the broker read is taken for lost",
        (f"{SWEEPER}::test_a_job_that_ends_while_the_broker_is_read_is_not_taken_for_lost",),
    ),
    Mutant(
        "lanes-bulk-always-first",
        "mailpipe/broker/lanes.py",
        "(bulk + live if self.credit >= 1 else live + bulk)",
        "(bulk + live if self.credit >= 0 else live + bulk)",
        "a backfill goes before live mail",
        (f"{LANE_ORDER}::test_control_goes_first_then_live_until_bulk_has_earned_a_job",),
    ),
    Mutant(
        "lanes-sweep-behind-jobs",
        "mailpipe/broker/lanes.py",
        "        return control + (bulk + live if self.credit >= 1 else live + bulk)",
        "        return (bulk + live if self.credit >= 1 else live + bulk) + control",
        "a sweep waits behind a backlog of jobs",
        (f"{LANE_ORDER}::test_a_sweep_never_waits_behind_a_backlog_and_earns_bulk_nothing",),
    ),
    Mutant(
        "lanes-bulk-banks-while-live-runs-alone",
        "mailpipe/broker/lanes.py",
        "        elif self.credit < 1:\n",
        "        else:\n",
        "bulk banks turns while it has no work, then holds live mail back for all of them",
        (f"{LANE_ORDER}::test_live_alone_leaves_bulk_one_turn_not_a_backlog_of_them",),
    ),
    Mutant(
        "lanes-bulk-runs-into-debt",
        "mailpipe/broker/lanes.py",
        "self.credit = max(self.credit + self.share - 1, Fraction(0))",
        "self.credit = self.credit + self.share - 1",
        "bulk run alone owes turns, and is starved once live mail comes",
        (f"{LANE_ORDER}::test_bulk_gets_everything_once_live_is_empty_and_banks_nothing",),
    ),
    Mutant(
        "rate-credit-banks",
        "mailpipe/coordination/ratelimit.py",
        "credit = math.min(1, credit + bulk_share)",
        "credit = credit + bulk_share",
        "bulk banks model calls while it runs alone, then takes them ahead of live calls",
        (f"{RATE_LANES}::test_bulk_banks_at_most_one_turn_of_credit_while_it_runs_alone",),
    ),
    Mutant(
        "rate-bulk-never-held",
        "mailpipe/coordination/ratelimit.py",
        "local held_for_live = bulk_on_credit and credit + bulk_share < 1 - 1e-9",
        "local held_for_live = false",
        "bulk model calls take the rate while live calls wait",
        (
            f"{RATE_LANES}::test_while_live_calls_wait_bulk_gets_its_share_of_the_rate_and_the_rate_holds",
        ),
    ),
    Mutant(
        "pause-probe-ends-any",
        "mailpipe/coordination/pauses.py",
        "if redis.call('hget', KEYS[1], 'token') ~= ARGV[1] then return 0 end",
        "if false then return 0 end",
        "a probe's passing check ends an operator's pause set while it ran",
        (f"{PAUSES}::test_a_probe_ends_only_the_pause_it_checked",),
    ),
    Mutant(
        "pause-operator-cannot-take-over",
        "mailpipe/coordination/pauses.py",
        "if redis.call('hget', KEYS[1], 'by') ~= 'operator' then",
        "if redis.call('exists', KEYS[1]) == 0 then",
        "an operator's pause of a stage paused by an outage ends with the outage",
        (f"{PAUSES}::test_an_operator_takes_over_an_outages_pause_with_their_reason",),
    ),
    Mutant(
        "pause-forgets-outage-start",
        "mailpipe/coordination/pauses.py",
        "local since = redis.call('get', KEYS[2]) or tostring(now)",
        "local since = tostring(now)",
        "an outage that flaps never reaches its alarm",
        (f"{PAUSES}::test_a_pause_soon_after_the_last_counts_from_the_outages_start",),
    ),
    Mutant(
        "pause-one-fault-more",
        "mailpipe/coordination/pauses.py",
        "redis.call('zcard', KEYS[3]) >= tonumber(ARGV[3])",
        "redis.call('zcard', KEYS[3]) > tonumber(ARGV[3])",
        "a stage pauses one email later than MAILPIPE_PAUSE_AFTER_EMAILS says",
        (f"{PAUSES}::test_pauses_below_the_threshold_wait_and_name_their_dependency",),
    ),
    Mutant(
        "dismiss-keeps-review",
        "mailpipe/pipeline/interventions.py",
        "    if dismissed:\n        emails.clear_review(session, dismissed)",
        "    if False:\n        emails.clear_review(session, dismissed)",
        "a dismissed email stays on the review list",
        (f"{ACTIONS}::test_dismiss_keeps_the_run_failed_and_takes_it_off_both_lists",),
    ),
    Mutant(
        "retry-in-the-live-lane",
        "mailpipe/operations/actions.py",
        "        places.update(emails.places(session, reopened))",
        "        places.update(dict.fromkeys(reopened, Place(Lane.LIVE.value, None)))",
        "an operator's retry of a bulk email jumps the live queue",
        (
            f"{LANES}::test_each_email_s_jobs_stay_in_its_lane_through_recovery_retry_move_and_hand_off",
        ),
    ),
    Mutant(
        "api-running-job-queued",
        "mailpipe/operations/status.py",
        '    if leased:\n        return "running", None',
        '    if False:\n        return "running", None',
        "the job API answers queued for a job that is running",
        (f"{STATUS}::test_job_state_for_every_state",),
    ),
    Mutant(
        "failed-list-lane-live",
        "mailpipe/operations/status.py",
        '            "lane": row.lane,',
        '            "lane": "live",',
        "the failed list shows every email in the live lane",
        (f"{STATUS}::test_the_failed_list_is_the_latest_first_without_dismissed_runs",),
    ),
    Mutant(
        "metrics-one-lane",
        "mailpipe/operations/sinks.py",
        '    lane = [*queue, {"Name": "Lane", "Value": metrics.lane.value}]',
        '    lane = [*queue, {"Name": "Lane", "Value": Lane.LIVE.value}]',
        "the bulk lane's figures are sent as the live lane's, and scaling reads the wrong backlog",
        (f"{METRICS}::test_each_lane_s_figures_name_the_stage_s_queue_and_the_lane",),
    ),
]


def run_mutant(
    mutant: Mutant, pytest_args: list[str], timeout: float, named: tuple[str, ...] = ()
) -> dict[str, object]:
    """Run pytest with `pytest_args` on a copy of the checkout with `mutant` written in, to its
    first failure. `named`: the tests that must be the one failing, when given."""
    with tempfile.TemporaryDirectory(prefix="mailpipe-mutant-") as tmp:
        copy = Path(tmp)
        for name in ("mailpipe", "tests"):
            shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
        target = copy / mutant.path
        source = target.read_text()
        if source.count(mutant.old) != 1:
            return {"name": mutant.name, "result": "not applied: the code moved"}
        target.write_text(source.replace(mutant.old, mutant.new))
        started = time.monotonic()
        env = {**_env(), "PYTHONPATH": str(copy)}
        # Its own session, so that the workers its tests start go with it on a timeout.
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *pytest_args],
            cwd=copy,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, _ = run.communicate(timeout=timeout)
            tail = stdout.strip().splitlines()[-1:] if stdout else []
            killer, message = _first_failure(stdout)
            result = verdict(run.returncode, killer, message, named)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
            result, tail, killer = "no verdict: timed out", ["timed out"], ""
        return {
            "name": mutant.name,
            "file": mutant.path,
            "why": mutant.why,
            "result": result,
            "killed_by": killer,
            "seconds": round(time.monotonic() - started, 1),
            "tests": " ".join(tail),
        }


# pytest's exit codes: 0 all passed, 1 some failed; the rest are no verdict on the code.
PASSED, FAILED = 0, 1


def verdict(returncode: int, killer: str, message: str, named: tuple[str, ...]) -> str:
    """`killed` only for a test that ran and failed on an assertion (one of `named`, if given);
    `survived` when every test passed; otherwise why there is no verdict."""
    if returncode == PASSED:
        return "survived"
    if returncode != FAILED or not killer:
        return f"no verdict: pytest exited {returncode} (collection, usage or services)"
    if named and killer not in named:
        return f"no verdict: {killer} failed, not a test the mutant names"
    # An assertion, or pytest's own verdict (`pytest.raises` that saw nothing, `pytest.fail`).
    if not message.startswith(("assert", "AssertionError", "Failed")):
        return f"no verdict: {killer} failed on {message.split(':')[0] or 'an error'}"
    return "killed"


def _first_failure(output: str) -> tuple[str, str]:
    """The first test that pytest's short summary (`-ra`) names as failed, and the exception it
    failed on, from the last line of its traceback (`path:line: ExceptionName`); an error in
    set-up or collection is no failure of the test."""
    _, _, summary = output.partition(" short test summary info ")
    for line in summary.splitlines():
        status, _, rest = line.partition(" ")
        if status == "ERROR":
            return "", rest
        if status == "FAILED":
            raised = re.search(r"^\S+\.py:\d+: (\w+(?:\.\w+)*)$", output, re.MULTILINE)
            if "+ Timeout +" in output:  # pytest-timeout's banner: the test was cut off
                return rest.split(" - ")[0].strip(), "Timeout"
            return rest.split(" - ")[0].strip(), raised.group(1) if raised else ""
    return "", ""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MAILPIPE_")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="names of the mutants to run")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--named-tests",
        action="store_true",
        help="run each mutant against the tests it names (`killed_by`) only, which must kill it",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    results = []
    for mutant in chosen:
        if args.named_tests:
            named = mutant.killed_by
            outcome = run_mutant(mutant, ["-n", "0", *named], args.timeout, named=named)
        else:
            outcome = run_mutant(mutant, TESTS, args.timeout)
        results.append(outcome)
        print(
            f"{outcome['result']:>9}  {mutant.name:<40} {outcome.get('seconds', ''):>6}"
            f"  {outcome.get('killed_by', '')}",
            flush=True,
        )
    killed = sum(r["result"] == "killed" for r in results)
    survived = sum(r["result"] == "survived" for r in results)
    others = len(results) - killed - survived
    print(f"\n{killed} killed, {survived} survived, {others} without a verdict, of {len(results)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
