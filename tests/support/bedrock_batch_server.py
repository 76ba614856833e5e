"""A local stand-in for Amazon Bedrock's control plane of batch inference, spoken over HTTP to
real botocore (the `bedrock` client, through `AWS_ENDPOINT_URL_BEDROCK`).

It answers `CreateModelInvocationJob`, `GetModelInvocationJob`, `StopModelInvocationJob` and
`ListModelInvocationJobs` in the rest-json shapes of botocore's service model. A job reads its
JSONL input from S3 (the moto server the tests run) and, once it completes, writes its output
as Bedrock documents it: `<output s3Uri>/<job id>/<input file name>.out`, one line per record,
`{"recordId", "modelInput", "modelOutput"}` with an InvokeModel-style Anthropic messages answer
(a `tool_use` block of the labels tool, `usage` with `input_tokens` and `output_tokens`), or
`{"recordId", "modelInput", "error": {...}}`; and a `manifest.json.out` with the counts.

A job runs when it is read (`GetModelInvocationJob`) `delay` seconds or more after it was
created. What it does is scripted per job (`script`, in the order jobs are created; `JobScript()`
once the scripts run out): complete, fail or expire, and leave some records with an error line
(`errors`) or with no line at all (`omitted`). `StopModelInvocationJob` stops a job that has
not run yet. A second create with the same `clientRequestToken` returns the first job.

    with BedrockBatchServer(s3_endpoint=...) as server:
        server.script(JobScript(errors=1))
        ...  # AWS_ENDPOINT_URL_BEDROCK=server.url
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

import boto3

from tests.support.bedrock_server import KEYWORDS, LoopbackServer

ACCOUNT = "123456789012"
REGION = "us-east-1"
_JOB = re.compile(r"^/model-invocation-job/(?P<job>[^/]+)(?P<stop>/stop)?$")
_ERROR_NAMESPACE = "http://internal.amazon.com/coral/com.amazon.bedrock/"


@dataclass(frozen=True)
class JobScript:
    """What one job does when it runs: its end (`Completed`, `Failed` or `Expired`), how many of
    its first records get an error line (`errors`) and how many after those get no line at all
    (`omitted`)."""

    status: str = "Completed"
    errors: int = 0
    omitted: int = 0
    message: str | None = None


@dataclass
class Job:
    job_id: str
    request: dict[str, Any]
    script: JobScript
    created: float
    status: str = "Submitted"
    message: str | None = None
    end_time: datetime | None = None
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def arn(self) -> str:
        return f"arn:aws:bedrock:{REGION}:{ACCOUNT}:model-invocation-job/{self.job_id}"


class BedrockBatchServer(LoopbackServer):
    """The server, its jobs and its script. Thread-safe."""

    def __init__(
        self, s3_endpoint: str, *, delay: float = 0.0, keys: dict[str, str] | None = None
    ) -> None:
        """`keys`: the S3 keys it reads and writes with (`AWS_ACCESS_KEY_ID`,
        `AWS_SECRET_ACCESS_KEY`), as Bedrock uses the role a job passes it."""
        self.delay = delay
        keys = keys or {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local"}
        self._s3 = boto3.session.Session(
            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
            region_name=REGION,
        ).client("s3", endpoint_url=s3_endpoint)
        self._lock = threading.Lock()
        self._scripts: deque[JobScript] = deque()
        self._jobs: dict[str, Job] = {}
        self._tokens: dict[str, str] = {}
        self.requests: list[tuple[str, str]] = []  # (operation, job id or "")
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.batch = self  # type: ignore[attr-defined]

    @property
    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def script(self, *scripts: JobScript) -> None:
        """The next jobs created do these, in order."""
        with self._lock:
            self._scripts.extend(scripts)

    # The operations: (status, body).

    def create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        missing = [
            name
            for name in ("jobName", "roleArn", "modelId", "inputDataConfig", "outputDataConfig")
            if name not in body
        ]
        if missing:
            return 400, _error("ValidationException", f"missing {', '.join(missing)}")
        with self._lock:
            token = body.get("clientRequestToken")
            if token in self._tokens:
                job = self._jobs[self._tokens[token]]
            else:
                script = self._scripts.popleft() if self._scripts else JobScript()
                job = Job(uuid.uuid4().hex[:12], body, script, time.monotonic())
                self._jobs[job.job_id] = job
                if token:
                    self._tokens[token] = job.job_id
            self.requests.append(("CreateModelInvocationJob", job.job_id))
        return 200, {"jobArn": job.arn}

    def get(self, identifier: str) -> tuple[int, dict[str, Any]]:
        job = self._job(identifier)
        if job is None:
            return 404, _error("ResourceNotFoundException", "no such job")
        with self._lock:
            self.requests.append(("GetModelInvocationJob", job.job_id))
            due = time.monotonic() - job.created >= self.delay
            if due and job.status in ("Submitted", "InProgress"):
                self._run(job)
            elif job.status == "Submitted":
                job.status = "InProgress"
            return 200, self._described(job)

    def stop_job(self, identifier: str) -> tuple[int, dict[str, Any]]:
        job = self._job(identifier)
        if job is None:
            return 404, _error("ResourceNotFoundException", "no such job")
        with self._lock:
            self.requests.append(("StopModelInvocationJob", job.job_id))
            if job.status not in ("Submitted", "InProgress"):
                return 409, _error("ConflictException", f"the job is {job.status}")
            job.status, job.end_time = "Stopped", datetime.now(UTC)
        return 200, {}

    def list_jobs(self) -> tuple[int, dict[str, Any]]:
        with self._lock:
            summaries = [self._summary(job) for job in self._jobs.values()]
        return 200, {"invocationJobSummaries": summaries}

    def _job(self, identifier: str) -> Job | None:
        with self._lock:
            return self._jobs.get(identifier.rsplit("/", 1)[-1])

    def _summary(self, job: Job) -> dict[str, Any]:
        return {
            "jobArn": job.arn,
            "jobName": job.request["jobName"],
            "modelId": job.request["modelId"],
            "roleArn": job.request["roleArn"],
            "status": job.status,
            "submitTime": _iso(job.created),
            "inputDataConfig": job.request["inputDataConfig"],
            "outputDataConfig": job.request["outputDataConfig"],
        }

    def _described(self, job: Job) -> dict[str, Any]:
        described = {
            **self._summary(job),
            "timeoutDurationInHours": job.request.get("timeoutDurationInHours", 24),
            **job.counts,
        }
        if job.message:
            described["message"] = job.message
        if job.end_time:
            described["endTime"] = job.end_time.isoformat()
        return described

    def _run(self, job: Job) -> None:
        """Run the job as its script says (under the lock)."""
        script = job.script
        job.end_time = datetime.now(UTC)
        if script.status != "Completed":
            job.status, job.message = script.status, script.message or f"the job {script.status}"
            return
        input_uri = job.request["inputDataConfig"]["s3InputDataConfig"]["s3Uri"]
        output_uri = job.request["outputDataConfig"]["s3OutputDataConfig"]["s3Uri"]
        bucket, key = _split(input_uri)
        records = [
            json.loads(line)
            for line in self._s3.get_object(Bucket=bucket, Key=key)["Body"].read().splitlines()
            if line.strip()
        ]
        lines = []
        for number, record in enumerate(records):
            if number < script.errors:
                lines.append(
                    {
                        **record,
                        "error": {"errorCode": 400, "errorMessage": "the record was refused"},
                    }
                )
            elif number < script.errors + script.omitted:
                continue
            else:
                lines.append({**record, "modelOutput": anthropic_answer(record["modelInput"])})
        out_bucket, out_prefix = _split(output_uri)
        folder = f"{out_prefix.rstrip('/')}/{job.job_id}/"
        name = key.rsplit("/", 1)[-1]
        body = "".join(json.dumps(line) + "\n" for line in lines).encode()
        self._s3.put_object(Bucket=out_bucket, Key=f"{folder}{name}.out", Body=body)
        succeeded = sum("modelOutput" in line for line in lines)
        job.counts = {
            "totalRecordCount": len(records),
            "processedRecordCount": len(lines),
            "successRecordCount": succeeded,
            "errorRecordCount": len(records) - succeeded,
        }
        manifest = {
            "totalRecordCount": len(records),
            "processedRecordCount": len(lines),
            "successRecordCount": succeeded,
            "errorRecordCount": len(records) - succeeded,
            "inputTokenCount": sum(
                line["modelOutput"]["usage"]["input_tokens"]
                for line in lines
                if "modelOutput" in line
            ),
            "outputTokenCount": sum(
                line["modelOutput"]["usage"]["output_tokens"]
                for line in lines
                if "modelOutput" in line
            ),
        }
        self._s3.put_object(
            Bucket=out_bucket, Key=f"{folder}manifest.json.out", Body=json.dumps(manifest).encode()
        )
        job.status = "Completed"


def anthropic_answer(model_input: dict[str, Any]) -> dict[str, Any]:
    """An InvokeModel answer of the Anthropic messages API to `model_input`: the labels tool
    called with the labels whose keywords the user text holds."""
    text = "\n".join(
        block.get("text", "")
        for message in model_input.get("messages", [])
        for block in message.get("content", [])
        if isinstance(block, dict)
    )
    tool = model_input["tools"][0]
    allowed = tool["input_schema"]["properties"]["labels"]["items"]["properties"]["label"]["enum"]
    lowered = text.lower()
    labels = [
        {"label": label, "confidence": 0.9}
        for label in allowed
        if any(word in lowered for word in KEYWORDS.get(label, (label,)))
    ]
    return {
        "id": f"msg_bdrk_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": "claude",
        "content": [
            {
                "type": "tool_use",
                "id": f"toolu_bdrk_{uuid.uuid4().hex[:24]}",
                "name": tool["name"],
                "input": {"labels": labels},
            }
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": len(text) // 4 + 1, "output_tokens": 12 + 8 * len(labels)},
    }


def _split(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


def _iso(monotonic: float) -> str:
    return datetime.fromtimestamp(time.time() - (time.monotonic() - monotonic), UTC).isoformat()


def _error(code: str, message: str) -> dict[str, Any]:
    return {"__type": f"{_ERROR_NAMESPACE}{code}", "message": message}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    @property
    def _batch(self) -> BedrockBatchServer:
        return self.server.batch  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = urlparse(self.path).path
        if path == "/model-invocation-job":
            self._send(*self._batch.create(json.loads(body or b"{}")))
            return
        match = _JOB.match(path)
        if match is None or not match["stop"]:
            self._send(404, _error("UnknownOperationException", f"no such operation: {path}"))
            return
        self._send(*self._batch.stop_job(unquote(match["job"])))

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/model-invocation-jobs":
            self._send(*self._batch.list_jobs())
            return
        match = _JOB.match(path)
        if match is None or match["stop"]:
            self._send(404, _error("UnknownOperationException", f"no such operation: {path}"))
            return
        self._send(*self._batch.get(unquote(match["job"])))

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        if status >= 400:
            self.send_header("x-amzn-ErrorType", body["__type"].rsplit("/", 1)[-1])
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass
