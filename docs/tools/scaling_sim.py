"""Simulate ECS target tracking on BacklogPerTask for the mailpipe worker service.

A discrete-time model (1 s steps) of what happens between an arrival burst and the jobs' queue
wait, with the delays that matter on AWS:

* jobs arrive as a Poisson process: a steady rate, a burst of `--burst-factor` times it for
  `--burst-minutes`, then the steady rate again;
* each worker task runs `--concurrency` jobs at once; job times are gamma distributed with mean
  `--mean-job-time` and coefficient of variation `--job-time-cv` (1 = exponential, 0 = fixed);
  the queue is FIFO and a free slot takes the oldest job;
* every `--period` seconds the app publishes BacklogPerTask = queued jobs / running tasks (tasks
  still starting are not counted: they do not report yet);
* target tracking's alarms: scale out after `--out-datapoints` consecutive datapoints above the
  target, scale in after `--in-datapoints` consecutive datapoints below `--in-ratio` x target;
  the new desired count is ceil(capacity x metric / target), clamped to [min, max]; while an alarm
  stays in ALARM the policy is re-evaluated every period. Inside the scale-out cooldown the
  capacity is the one before the scale-out that started it (AWS: the capacity added "is
  calculated as part of the desired capacity for the next scale out"), so a stale metric does not
  compound; after it, the current desired count. The scale-in cooldown blocks scale-in, and so
  does a running scale-out cooldown; `--action-lag` seconds pass between the end of a period and
  the desired-count change (CloudWatch ingestion, alarm evaluation, the scaling call);
* optionally a second target tracking policy on CPU (`--cpu-target`), with a busy process counted
  as its share of the task's vCPU: any policy may scale out, scale-in needs both;
* a new task runs after a start time drawn uniformly from `--start-time` (Fargate image pull and
  container start); a stopped task takes no new job and gives its running jobs
  `--soft-shutdown` seconds to finish, then requeues them at the head of the queue (Celery's soft
  shutdown under REMAP_SIGTERM=SIGQUIT);
* cost is task-minutes from launch to stop, as Fargate bills them.

Not modelled: prefetched messages (two per process, out of the Redis queue's count; small against
the backlog), broker or database limits, the model role and its call rate limit.

    .venv/bin/python docs/tools/scaling_sim.py --mean-job-time 0.026 --base-rate 115.4 \\
        --targets 577,1154,2308,4615,9231 --plot docs/img/scaling.png --json out.json

docs/scaling.md has every command and where the job time comes from.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Scenario:
    mean_job_time: float = 1.5  # seconds per job, per process
    job_time_cv: float = 1.0
    concurrency: int = 2  # MAILPIPE_WORKER_CONCURRENCY
    base_rate: float = 2.0  # jobs per second outside the burst
    burst_factor: float = 10.0
    burst_start_min: float = 30.0
    burst_minutes: float = 20.0
    duration_min: float = 120.0
    period: int = 60  # CloudWatch metric period (s)
    out_datapoints: int = 3
    in_datapoints: int = 15
    in_ratio: float = 0.9
    scale_out_cooldown: float = 60.0
    scale_in_cooldown: float = 300.0
    action_lag: float = 30.0
    start_time: tuple[float, float] = (60.0, 90.0)
    soft_shutdown: float = 90.0
    cpu_target: float = 0.0  # a second target tracking policy on CPU utilization (%); 0: none
    # Share of its vCPU a busy process uses: lower when jobs wait on Bedrock.
    cpu_per_busy: float = 1.0
    min_tasks: int = 2
    max_tasks: int = 40
    seed: int = 7

    def rate_at(self, t: float) -> float:
        start = self.burst_start_min * 60
        end = start + self.burst_minutes * 60
        return self.base_rate * (self.burst_factor if start <= t < end else 1.0)

    @property
    def burst_window(self) -> tuple[float, float]:
        start = self.burst_start_min * 60
        return start, start + self.burst_minutes * 60


@dataclass
class Task:
    launched_at: float
    ready_at: float
    slots: list[float]  # time each process is free again
    jobs: list[tuple[float, float] | None]  # (arrival, job time) each process runs, None when idle
    stop_at: float | None = None  # SIGTERM received

    def running(self, t: float) -> bool:
        return self.ready_at <= t and self.stop_at is None


@dataclass
class Result:
    target: float
    waits: np.ndarray  # queue wait per job (s), in arrival order of first delivery
    arrivals: np.ndarray
    unstarted: int
    task_seconds: float
    minutes: list[int] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    desired: list[int] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    requeued: int = 0

    def wait_pct(self, q: float, window: tuple[float, float] | None = None) -> float:
        waits = self.waits
        if window is not None:
            waits = waits[(self.arrivals >= window[0]) & (self.arrivals < window[1])]
        return float(np.percentile(waits, q)) if len(waits) else 0.0

    def p95_by_arrival_minute(self) -> list[float]:
        minute = (self.arrivals // 60).astype(int)
        out = []
        for m in self.minutes:
            w = self.waits[minute == m]
            out.append(float(np.percentile(w, 95)) if len(w) else 0.0)
        return out

    def summary(self, scenario: Scenario) -> dict:
        burst = scenario.burst_window
        # Jobs arriving during the burst and until its backlog can have cleared.
        after_burst = (burst[0], burst[1] + 15 * 60)
        return {
            "target": self.target,
            "p50_wait_s": round(self.wait_pct(50), 1),
            "p95_wait_s": round(self.wait_pct(95), 1),
            "max_wait_s": round(float(self.waits.max()), 1),
            "burst_p50_wait_s": round(self.wait_pct(50, after_burst), 1),
            "burst_p95_wait_s": round(self.wait_pct(95, after_burst), 1),
            "steady_p95_wait_s": round(self.wait_pct(95, (0, burst[0])), 1),
            "max_backlog": max(self.backlog),
            "max_tasks": max(self.running),
            "task_minutes": round(self.task_seconds / 60, 1),
            "requeued_jobs": self.requeued,
            "unstarted_jobs": self.unstarted,
        }


def simulate(scenario: Scenario, target: float) -> Result:
    # Separate streams, so that every target sees the same jobs (arrival and duration).
    arrival_rng = np.random.default_rng(scenario.seed)
    job_rng = np.random.default_rng(scenario.seed + 1)
    start_rng = np.random.default_rng(scenario.seed + 2)
    end = int(scenario.duration_min * 60)
    c = scenario.concurrency
    shape = 1 / scenario.job_time_cv**2 if scenario.job_time_cv > 0 else None

    def job_time() -> float:
        if shape is None:
            return scenario.mean_job_time
        return float(job_rng.gamma(shape, scenario.mean_job_time / shape))

    def new_task(t: float, ready_now: bool = False) -> Task:
        ready = t if ready_now else t + float(start_rng.uniform(*scenario.start_time))
        return Task(launched_at=t, ready_at=ready, slots=[ready] * c, jobs=[None] * c)

    tasks = [new_task(0, ready_now=True) for _ in range(scenario.min_tasks)]
    desired = scenario.min_tasks
    queue: deque[tuple[float, float]] = deque()  # (arrival, job time), oldest first
    waits: list[tuple[float, float]] = []  # (arrival, wait)
    task_seconds = 0.0
    requeued = 0
    datapoints: list[float] = []  # BacklogPerTask, one per period
    cpu_points: list[float] = []  # busy processes / processes, in %, one per period
    busy_s = slot_s = 0.0
    policies = [(target, datapoints)] + (
        [(scenario.cpu_target, cpu_points)] if scenario.cpu_target else []
    )
    pending_actions: list[tuple[float, int]] = []  # (apply at, datapoint index)
    last_out = last_in = -math.inf
    base_out = scenario.min_tasks  # desired count before the scale-out that started the cooldown
    res = Result(
        target=target, waits=np.empty(0), arrivals=np.empty(0), unstarted=0, task_seconds=0
    )

    for t in range(end):
        # Publish a datapoint at each period boundary: the snapshot the app reports.
        if t > 0 and t % scenario.period == 0:
            running = sum(task.running(t) for task in tasks)
            datapoints.append(len(queue) / max(running, 1))
            cpu_points.append(100 * busy_s / slot_s if slot_s else 0.0)
            busy_s = slot_s = 0.0
            pending_actions.append((t + scenario.action_lag, len(datapoints)))
            res.minutes.append(t // 60 - 1)
            res.backlog.append(len(queue))
            res.running.append(sum(task.running(t) for task in tasks))
            res.desired.append(desired)
            res.metric.append(datapoints[-1])
            res.cpu.append(cpu_points[-1])

        # Target tracking: evaluate each policy's alarms on the datapoints published so far. Any
        # policy may scale out; scale-in happens only when every policy wants it, to the largest
        # count any of them proposes.
        while pending_actions and pending_actions[0][0] <= t:
            _, n = pending_actions.pop(0)
            outs, ins = [], []
            # Inside a scale-out cooldown the capacity that scale-out added counts toward the next
            # one, so it is computed from the capacity before it rather than compounded on top.
            base = base_out if t - last_out < scenario.scale_out_cooldown else desired
            for tgt, points in policies:
                recent = points[:n]
                proposed = min(
                    scenario.max_tasks, max(scenario.min_tasks, math.ceil(base * recent[-1] / tgt))
                )
                if len(recent) >= scenario.out_datapoints and all(
                    d > tgt for d in recent[-scenario.out_datapoints :]
                ):
                    outs.append(proposed)
                low = len(recent) >= scenario.in_datapoints and all(
                    d < scenario.in_ratio * tgt for d in recent[-scenario.in_datapoints :]
                )
                ins.append(proposed if low else None)
            if outs and max(outs) > desired:
                if t - last_out >= scenario.scale_out_cooldown:
                    base_out, last_out = desired, t
                desired, last_in = max(outs), -math.inf  # a scale-out ends a scale-in cooldown
            elif (
                None not in ins
                and max(ins) < desired
                and t - last_in >= scenario.scale_in_cooldown
                and t - last_out >= scenario.scale_out_cooldown
            ):
                desired, last_in = max(ins), t

        # ECS reconciles the service to the desired count: start tasks, or stop the newest ones
        # (pending first). A stopped task takes no new job; its running jobs get the soft shutdown.
        active = [task for task in tasks if task.stop_at is None]
        if len(active) < desired:
            tasks.extend(new_task(t) for _ in range(desired - len(active)))
        elif len(active) > desired:
            for task in sorted(active, key=lambda k: (k.ready_at <= t, -k.launched_at))[
                : len(active) - desired
            ]:
                task.stop_at = t
                if task.ready_at > t:  # still starting: gone at once
                    task_seconds += t - task.launched_at
                    tasks.remove(task)

        # Arrivals in [t, t+1).
        n = arrival_rng.poisson(scenario.rate_at(t))
        queue.extend((a, job_time()) for a in sorted(t + arrival_rng.random(n)))

        # Stopping tasks: jobs past the soft-shutdown window go back to the head of the queue.
        for task in tasks:
            if task.stop_at is None:
                continue
            deadline = task.stop_at + scenario.soft_shutdown
            if t + 1 >= deadline:
                late = [
                    job
                    for job, free in zip(task.jobs, task.slots, strict=True)
                    if job is not None and free > deadline
                ]
                requeued += len(late)
                queue.extendleft(sorted(late, reverse=True))
                # A requeued job's wait is counted again from its arrival when it next starts.
                for job in late:
                    waits.remove(next(w for w in waits if w[0] == job[0]))
                task.slots = [min(free, deadline) for free in task.slots]
                task.jobs = [None] * c
        for task in list(tasks):
            if task.stop_at is not None and all(free <= t + 1 for free in task.slots):
                task_seconds += max([task.stop_at, *task.slots]) - task.launched_at
                tasks.remove(task)

        # Hand queued jobs to free processes in FIFO order, exactly (earliest free slot first).
        heap = [
            (max(free, task.ready_at), i, k)
            for i, task in enumerate(tasks)
            if task.stop_at is None and task.ready_at < t + 1
            for k, free in enumerate(task.slots)
        ]
        heapq.heapify(heap)
        while queue and heap:
            free, i, k = heap[0]
            start = max(free, queue[0][0], t)
            if start >= t + 1:
                break
            heapq.heappop(heap)
            arrival, duration = job = queue.popleft()
            finish = start + duration
            tasks[i].slots[k], tasks[i].jobs[k] = finish, job
            busy_s += duration * scenario.cpu_per_busy
            waits.append((arrival, start - arrival))
            heapq.heappush(heap, (finish, i, k))

        # What ECS's CPU metric would see, taking a busy process as its share of the task's vCPU
        # (a job's time counts in the period it starts in).
        slot_s += c * sum(task.ready_at <= t for task in tasks)

    for task in tasks:
        task_seconds += end - task.launched_at
    arr = np.array(waits)
    res.arrivals, res.waits = arr[:, 0], arr[:, 1]
    # Jobs still queued at the end count with the wait they have had so far.
    if queue:
        left = np.array([a for a, _ in queue])
        res.arrivals = np.concatenate([res.arrivals, left])
        res.waits = np.concatenate([res.waits, end - left])
    res.unstarted = len(queue)
    res.task_seconds = task_seconds
    res.requeued = requeued
    return res


def table(rows: list[dict]) -> str:
    cols = [
        ("target", "target"),
        ("p50_wait_s", "p50 s"),
        ("p95_wait_s", "p95 s"),
        ("max_wait_s", "max s"),
        ("steady_p95_wait_s", "steady p95"),
        ("burst_p95_wait_s", "burst p95"),
        ("max_backlog", "max backlog"),
        ("max_tasks", "max tasks"),
        ("task_minutes", "task-min"),
    ]
    head = "| " + " | ".join(h for _, h in cols) + " |"
    sep = "| " + " | ".join("---:" for _ in cols) + " |"
    body = ["| " + " | ".join(f"{r[k]:g}" for k, _ in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def plot(scenario: Scenario, results: list[Result], highlight: float | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    b0, b1 = scenario.burst_window
    for res in results:
        bold = res.target == highlight
        style = {"linewidth": 2.4 if bold else 1.0, "alpha": 1.0 if bold else 0.7}
        label = f"target {res.target:g}" + (" (recommended)" if bold else "")
        m = res.minutes
        axes[0].plot(m, res.backlog, label=label, **style)
        axes[1].step(m, res.running, where="post", label=label, **style)
        axes[2].plot(m, res.p95_by_arrival_minute(), label=label, **style)
    for ax in axes:
        ax.axvspan(b0 / 60, b1 / 60, color="0.9", zorder=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("queued jobs")
    axes[0].set_title(
        f"{scenario.burst_factor:g}x burst for {scenario.burst_minutes:g} min (shaded), "
        f"base {scenario.base_rate:g} jobs/s, mean job {scenario.mean_job_time:g} s, "
        f"concurrency {scenario.concurrency}\n"
        f"tasks {scenario.min_tasks}-{scenario.max_tasks}, "
        f"cooldown out {scenario.scale_out_cooldown:g} s / in {scenario.scale_in_cooldown:g} s, "
        f"start {scenario.start_time[0]:g}-{scenario.start_time[1]:g} s, "
        + (
            f"plus CPU policy at {scenario.cpu_target:g} %"
            if scenario.cpu_target
            else "BacklogPerTask policy only"
        ),
        fontsize=10,
    )
    axes[1].set_ylabel("running tasks")
    axes[2].set_ylabel("p95 queue wait (s)\nby arrival minute")
    axes[2].set_xlabel("minute")
    axes[0].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    d = Scenario()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mean-job-time", type=float, default=d.mean_job_time, help="seconds per job per process"
    )
    p.add_argument("--job-time-cv", type=float, default=d.job_time_cv)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--base-rate", type=float, default=d.base_rate, help="jobs/s outside the burst")
    p.add_argument("--burst-factor", type=float, default=d.burst_factor)
    p.add_argument("--burst-start", type=float, default=d.burst_start_min, help="minute")
    p.add_argument("--burst-minutes", type=float, default=d.burst_minutes)
    p.add_argument("--duration", type=float, default=d.duration_min, help="minutes")
    p.add_argument(
        "--targets", default="10,20,40,80,160", help="comma-separated BacklogPerTask targets"
    )
    p.add_argument(
        "--acceptable-latency",
        type=float,
        default=60.0,
        help="queue wait (s) the recommended target is derived from",
    )
    p.add_argument("--period", type=int, default=d.period)
    p.add_argument("--out-datapoints", type=int, default=d.out_datapoints)
    p.add_argument("--in-datapoints", type=int, default=d.in_datapoints)
    p.add_argument("--in-ratio", type=float, default=d.in_ratio)
    p.add_argument("--scale-out-cooldown", type=float, default=d.scale_out_cooldown)
    p.add_argument("--scale-in-cooldown", type=float, default=d.scale_in_cooldown)
    p.add_argument("--action-lag", type=float, default=d.action_lag)
    p.add_argument(
        "--start-time", default=f"{d.start_time[0]:g},{d.start_time[1]:g}", help="min,max seconds"
    )
    p.add_argument("--soft-shutdown", type=float, default=d.soft_shutdown)
    p.add_argument(
        "--cpu-target",
        type=float,
        default=d.cpu_target,
        help="add a second target tracking policy on ECS CPU utilization (%%); 0: none",
    )
    p.add_argument(
        "--cpu-per-busy",
        type=float,
        default=d.cpu_per_busy,
        help="share of its vCPU a busy process uses (1: CPU-bound jobs)",
    )
    p.add_argument("--min-tasks", type=int, default=d.min_tasks)
    p.add_argument("--max-tasks", type=int, default=d.max_tasks)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--plot", help="write a PNG of backlog, tasks and p95 wait over time")
    p.add_argument("--json", help="write the summaries and the scenario as JSON")
    a = p.parse_args(argv)

    lo, hi = (float(x) for x in a.start_time.split(","))
    scenario = Scenario(
        mean_job_time=a.mean_job_time,
        job_time_cv=a.job_time_cv,
        concurrency=a.concurrency,
        base_rate=a.base_rate,
        burst_factor=a.burst_factor,
        burst_start_min=a.burst_start,
        burst_minutes=a.burst_minutes,
        duration_min=a.duration,
        period=a.period,
        out_datapoints=a.out_datapoints,
        in_datapoints=a.in_datapoints,
        in_ratio=a.in_ratio,
        scale_out_cooldown=a.scale_out_cooldown,
        scale_in_cooldown=a.scale_in_cooldown,
        action_lag=a.action_lag,
        start_time=(lo, hi),
        soft_shutdown=a.soft_shutdown,
        cpu_target=a.cpu_target,
        cpu_per_busy=a.cpu_per_busy,
        min_tasks=a.min_tasks,
        max_tasks=a.max_tasks,
        seed=a.seed,
    )
    recommended = round(a.acceptable_latency * a.concurrency / a.mean_job_time)
    targets = sorted({float(x) for x in a.targets.split(",")} | {float(recommended)})
    per_task = a.concurrency / a.mean_job_time
    print(
        f"one task drains {per_task:.2f} jobs/s; "
        f"steady load needs {a.base_rate / per_task:.1f} tasks, "
        f"the burst {a.base_rate * a.burst_factor / per_task:.1f}; recommended target "
        f"{a.acceptable_latency:g} s x {a.concurrency} / {a.mean_job_time:g} s = {recommended}"
    )
    results = [simulate(scenario, t) for t in targets]
    rows = [r.summary(scenario) for r in results]
    print(table(rows))
    if a.plot:
        plot(scenario, results, float(recommended), a.plot)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"scenario": asdict(scenario), "recommended_target": recommended, "results": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
