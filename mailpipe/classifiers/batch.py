"""Bedrock batch inference for the `bedrock` classifier: the records, the answers, the jobs.

A record's `modelInput` is the InvokeModel body of the Anthropic messages API, built from the
same prompt and the same labels tool as the `converse` call (mailpipe.classifiers.prompt), so a
batch answer and a real-time answer are read by one rule (`usable_labels`). The jobs are
created, read and stopped through the `bedrock` control-plane client (boto3 honours
`AWS_ENDPOINT_URL_BEDROCK`). Nothing here logs a record: the records hold the email.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config

from mailpipe.classifiers import ClassificationResult, EmailForClassifier
from mailpipe.classifiers.bedrock import one_tool_input, usable_labels
from mailpipe.classifiers.prompt import PROMPT_VERSION, TOOL_NAME, build_prompt, tool_config

if TYPE_CHECKING:
    from mailpipe.settings import Settings

ANTHROPIC_VERSION = "bedrock-2023-05-31"
# The provider's statuses, as GetModelInvocationJob names them.
COMPLETED = frozenset({"Completed", "PartiallyCompleted"})
ENDED = frozenset({"Failed", "Stopped", "Expired"})


@dataclass(frozen=True)
class JobStatus:
    """A job as GetModelInvocationJob reads it; `message`: the provider's, for a job that
    ended (it names the job or the role, never a record)."""

    status: str
    message: str | None


class BatchModel:
    """The records of one model and label set, and its batch jobs."""

    def __init__(
        self,
        *,
        model_id: str,
        labels: Sequence[str],
        region: str,
        role_arn: str,
        max_tokens: int,
        text_budget: int,
        timeout_hours: int,
    ) -> None:
        self.model_id = model_id
        self._labels = tuple(labels)
        self._role_arn = role_arn
        self._max_tokens = max_tokens
        self._text_budget = text_budget
        self._timeout_hours = timeout_hours
        spec = tool_config(self._labels)["tools"][0]["toolSpec"]
        self._tool = {
            "name": spec["name"],
            "description": spec["description"],
            "input_schema": spec["inputSchema"]["json"],
        }
        self._client = boto3.session.Session().client(
            "bedrock",
            region_name=region,
            config=Config(retries={"mode": "standard"}, connect_timeout=5, read_timeout=30),
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> BatchModel:
        return cls(
            model_id=settings.bedrock_model_id,
            labels=settings.labels,
            region=settings.bedrock_region,
            role_arn=settings.model_batch_role_arn or "",
            max_tokens=settings.bedrock_max_tokens,
            text_budget=settings.classifier_text_budget,
            timeout_hours=settings.model_batch_timeout_hours,
        )

    def model_input(self, email: EmailForClassifier) -> dict[str, Any]:
        """The InvokeModel body for `email`: the `converse` call's prompt and forced tool."""
        prompt = build_prompt(email, self._labels, self._text_budget)
        return {
            "anthropic_version": ANTHROPIC_VERSION,
            "max_tokens": self._max_tokens,
            "temperature": 0,
            "system": prompt.system,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt.user}]}],
            "tools": [self._tool],
            "tool_choice": {"type": "tool", "name": TOOL_NAME},
        }

    def result(self, model_output: Mapping[str, Any]) -> ClassificationResult:
        """The classification in a record's `modelOutput`, read as a `converse` answer is;
        raises PermanentError, naming the output's shape only, when it has no usable answer."""
        content = model_output.get("content")
        blocks = content if isinstance(content, list) else []
        inputs = [
            block.get("input")
            for block in blocks
            if isinstance(block, dict)
            and block.get("type") == "tool_use"
            and block.get("name") == TOOL_NAME
        ]
        stop = f"stop_reason={model_output.get('stop_reason')}"
        tool_input = one_tool_input(inputs, len(blocks), stop)
        labels, dropped = usable_labels(tool_input, self._labels)
        usage = model_output.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        return ClassificationResult(
            labels=labels,
            model_id=self.model_id,
            prompt_version=PROMPT_VERSION,
            output=tool_input,
            input_tokens=_count(usage.get("input_tokens")),
            output_tokens=_count(usage.get("output_tokens")),
            latency_ms=0,  # a batch answer has no latency of its own
            dropped_labels=dropped,
        )

    def submit(self, name: str, token: str, input_uri: str, output_uri: str) -> str:
        """Create the job (once for `token`, however often it is asked) and return its ARN."""
        response = self._client.create_model_invocation_job(
            jobName=name,
            clientRequestToken=token,
            roleArn=self._role_arn,
            modelId=self.model_id,
            inputDataConfig={"s3InputDataConfig": {"s3Uri": input_uri, "s3InputFormat": "JSONL"}},
            outputDataConfig={"s3OutputDataConfig": {"s3Uri": output_uri}},
            timeoutDurationInHours=self._timeout_hours,
        )
        return str(response["jobArn"])

    def status(self, job_arn: str) -> JobStatus:
        response = self._client.get_model_invocation_job(jobIdentifier=job_arn)
        return JobStatus(str(response["status"]), response.get("message"))

    def stop(self, job_arn: str) -> None:
        self._client.stop_model_invocation_job(jobIdentifier=job_arn)


def job_id(job_arn: str) -> str:
    """The job's id, the last part of its ARN: the folder Bedrock writes its output under."""
    return job_arn.rsplit("/", 1)[-1]


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
