"""The `bedrock` classifier: Amazon Bedrock's `converse` API with labels as forced tool use.

The model must answer by calling one tool whose input schema lists the configured labels, so the
answer is structured data checked against that list, not prose to be scraped; entries outside it
are dropped and counted. Errors are sorted for the task layer: throttling is `Throttled` (the job
defers); outages and timeouts are `ModelUnavailable`, and credentials, permissions, an unknown
model id and the like `ModelAccessDenied`, both judged by the model's check (an outage or a
refusal of the fleet fails no email); a request Bedrock rejects and an answer we cannot use at all
are `PermanentError` (the run fails at once).

Nothing here logs the email: not the body, not the prompt, not the model's text. Keep the
`botocore` logger above DEBUG in production, because botocore logs request bodies at DEBUG.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    NoAuthTokenError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from mailpipe.classifiers import ClassificationResult, EmailForClassifier, LabelScore
from mailpipe.classifiers.prompt import PROMPT_VERSION, TOOL_NAME, build_prompt, tool_config
from mailpipe.errors import (
    ModelAccessDenied,
    ModelUnavailable,
    PermanentError,
    Throttled,
    describe,
)

if TYPE_CHECKING:
    from mailpipe.settings import Settings

log = logging.getLogger(__name__)

# Error codes worth another try later, by the task layer: botocore tries each call once
# (`_MAX_ATTEMPTS`).
_TRANSIENT_CODES = frozenset(
    {
        "ThrottlingException",
        "ServiceUnavailableException",
        "ModelNotReadyException",
        "InternalServerException",
        "ModelTimeoutException",
        # The model failed while running; Bedrock documents it as retryable, and the task layer's
        # retry cap bounds the cost if it is not.
        "ModelErrorException",
    }
)
# Error codes that say the fleet, not the email, is wrong: every email would fail the same way
# until an operator acts. From the service model: model access not granted in this region or an
# IAM policy without the model (AccessDenied), a model id unknown in the region or retired
# (ResourceNotFound), an account quota (ServiceQuotaExceeded, lifted by a quota increase). From
# AWS's front end for every service: credentials it does not know, a wrong secret, an expired
# session token.
_FLEET_CODES = frozenset(
    {
        "AccessDeniedException",
        "ResourceNotFoundException",
        "ServiceQuotaExceededException",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "IncompleteSignatureException",
        "MissingAuthenticationTokenException",
        "ExpiredTokenException",
    }
)
# ValidationException covers both one bad request (input too long) and a fleet's configuration
# that no request can pass; these messages are the second kind: an unknown model id, a model that
# needs an inference profile, a retired model, a model without (forced) tool use. AWS writes
# "isn't" with a typographic apostrophe, hence the patterns' dots.
_FLEET_VALIDATION = re.compile(
    r"model identifier is invalid|on-demand throughput is|end of its life"
    r"|doesn.t support (?:tool use|the toolconfig)",
    re.IGNORECASE,
)
# Botocore's errors for credentials it cannot find or fetch: the call never left the process.
_CREDENTIAL_ERRORS = (
    NoCredentialsError,
    PartialCredentialsError,
    CredentialRetrievalError,
    NoAuthTokenError,
)
# When throttled without a Retry-After header: long enough for a per-minute quota window to move
# on noticeably, short enough that a brief burst does not stall the email for minutes.
THROTTLE_RETRY_AFTER_S = 10.0

# Worst case of one `classify` call: one try (`_MAX_ATTEMPTS`) of connect 5 s + read 30 s, about
# 35 s. That stays well under the fleet rate limiter's slot TTL (120 s), so a slow call never
# loses its slot; the model role's threads enforce no Celery time limit, so these end the call.
# A label call answers in seconds (a few hundred output tokens), so 30 s of silence means trouble.
_CONNECT_TIMEOUT_S = 5.0
_READ_TIMEOUT_S = 30.0
# One try per call: each call holds a fleet rate-limit slot, and botocore's own retries would send
# up to three requests for one slot. A throttled or failed call goes back to the task layer, which
# defers (throttling) or retries with backoff (5xx) under the limiter again.
_MAX_ATTEMPTS = 1
# Connections kept open to the endpoint, one per thread calling at once: the model role runs 32
# threads. botocore keeps 10 by default, and a call beyond them opens a connection (TLS and all)
# that is closed again after it, with a warning ("Connection pool is full").
_MAX_CONNECTIONS = 64
# The model's check (`check`): a prompt of a few tokens that holds nothing of any email.
_CHECK_SYSTEM = "Health check of the labelling service."
_CHECK_USER = "Reply with no labels."
_CHECK_MAX_TOKENS = 16


class BedrockClassifier:
    """Classify emails with a Bedrock model through `converse` and a forced labels tool.

    The boto3 client is built in the constructor from a fresh session (boto3's default session is
    not thread-safe), so build the classifier per process, after fork. Without `endpoint_url`,
    boto3 honours `AWS_ENDPOINT_URL_BEDROCK_RUNTIME` and `AWS_ENDPOINT_URL` itself.
    """

    def __init__(
        self,
        *,
        model_id: str,
        labels: Sequence[str],
        region: str,
        max_tokens: int = 256,
        text_budget: int = 24_000,
        endpoint_url: str | None = None,
        max_attempts: int = _MAX_ATTEMPTS,
        connect_timeout: float = _CONNECT_TIMEOUT_S,
        read_timeout: float = _READ_TIMEOUT_S,
    ) -> None:
        if not labels or len(set(labels)) != len(labels):
            raise ValueError("labels must be a non-empty list without repeats")
        self.model_id = model_id
        self.remote = True  # a paid call: the pipeline takes a fleet-wide rate-limit slot for it
        self._labels = tuple(labels)
        self._max_tokens = max_tokens
        self._text_budget = text_budget
        self._tool_config = tool_config(self._labels)
        self._client = boto3.session.Session().client(
            "bedrock-runtime",
            region_name=region,
            endpoint_url=endpoint_url,
            config=Config(
                # `total_max_attempts` counts the first try; botocore's `max_attempts` key would
                # count retries only, so {"max_attempts": 3} means four calls.
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=_MAX_CONNECTIONS,
            ),
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> BedrockClassifier:
        return cls(
            model_id=settings.bedrock_model_id,
            labels=settings.labels,
            region=settings.bedrock_region,
            max_tokens=settings.bedrock_max_tokens,
            text_budget=settings.classifier_text_budget,
        )

    def check(self) -> None:
        """One call of a few tokens with the labels tool, the model and the role of every
        classification: what refuses this refuses them all. Its answer is not read."""
        self._converse(_CHECK_SYSTEM, _CHECK_USER, _CHECK_MAX_TOKENS)

    def _converse(self, system: str, user: str, max_tokens: int) -> Mapping[str, Any]:
        try:
            return self._client.converse(
                modelId=self.model_id,
                system=[{"text": system}],
                messages=[{"role": "user", "content": [{"text": user}]}],
                inferenceConfig={"maxTokens": max_tokens, "temperature": 0},
                toolConfig=self._tool_config,
            )
        except ClientError as error:
            raise _classify_client_error(error) from error
        except _CREDENTIAL_ERRORS as error:
            raise ModelAccessDenied(f"bedrock credentials: {describe(error)}") from error
        except (BotoConnectionError, HTTPClientError) as error:
            # Connection refused or reset, connect or read timeout: the service, not the email.
            raise ModelUnavailable(f"bedrock unreachable: {describe(error)}") from error

    def classify(self, email: EmailForClassifier) -> ClassificationResult:
        """Labels for `email`. Not idempotent by itself (each call is billed); callers store it."""
        prompt = build_prompt(email, self._labels, self._text_budget)
        started = time.monotonic()
        response = self._converse(prompt.system, prompt.user, self._max_tokens)
        measured_ms = round((time.monotonic() - started) * 1000)

        tool_input = _tool_input(response)
        labels, dropped = usable_labels(tool_input, self._labels)
        usage = response.get("usage", {})
        latency_ms = response.get("metrics", {}).get("latencyMs")
        result = ClassificationResult(
            labels=labels,
            model_id=self.model_id,
            prompt_version=PROMPT_VERSION,
            output=tool_input,
            input_tokens=usage.get("inputTokens"),
            output_tokens=usage.get("outputTokens"),
            latency_ms=latency_ms if isinstance(latency_ms, int) else measured_ms,
            dropped_labels=dropped,
        )
        log.debug(
            "classified with %s (prompt %s%s): %d labels, %d dropped, %s in / %s out tokens, %d ms",
            self.model_id,
            PROMPT_VERSION,
            ", truncated" if prompt.truncated else "",
            len(labels),
            dropped,
            result.input_tokens,
            result.output_tokens,
            result.latency_ms,
        )
        return result


def _classify_client_error(
    error: ClientError,
) -> Throttled | ModelUnavailable | ModelAccessDenied | PermanentError:
    """The mailpipe error for an error response from Bedrock. The messages name the code and,
    for the service's and the fleet's errors, Bedrock's message, which names the model or the
    role; a request rejected on its own is named by its code alone, as its message may quote
    the request, which holds the email."""
    details = error.response.get("Error", {})
    code = details.get("Code", "")
    message = details.get("Message", "")
    metadata = error.response.get("ResponseMetadata", {})
    status = metadata.get("HTTPStatusCode", 0)
    if code == "ThrottlingException":
        retry_after = _retry_after(metadata.get("HTTPHeaders", {}))
        return Throttled(f"bedrock throttled the call: {message}", retry_after=retry_after)
    if code in _TRANSIENT_CODES or status >= 500:
        return ModelUnavailable(f"bedrock unavailable ({code or status}): {message}")
    if code in _FLEET_CODES or (
        code == "ValidationException" and _FLEET_VALIDATION.search(message)
    ):
        return ModelAccessDenied(f"bedrock refused the call ({code}): {message}")
    # Any other ValidationException (input too long) or 4xx: the same request fails the same way
    # next time, and other requests need not.
    return PermanentError(f"bedrock rejected the request ({code or status})")


def _retry_after(headers: Mapping[str, str]) -> float:
    """Seconds to wait from the response headers (botocore lower-cases them), else our default."""
    for name, scale in (("x-amz-retry-after", 0.001), ("retry-after", 1.0)):
        try:
            seconds = float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    return THROTTLE_RETRY_AFTER_S


def _tool_input(response: Mapping[str, Any]) -> dict[str, Any]:
    """The input of the one call of our tool in the response."""
    content = response.get("output", {}).get("message", {}).get("content", [])
    inputs = [
        block["toolUse"].get("input")
        for block in content
        if isinstance(block, dict) and block.get("toolUse", {}).get("name") == TOOL_NAME
    ]
    return one_tool_input(inputs, len(content), f"stopReason={response.get('stopReason')}")


def one_tool_input(inputs: Sequence[object], blocks: int, stop: str) -> dict[str, Any]:
    """The input of the one call of our tool, given the inputs of its calls among the answer's
    `blocks` content blocks, and how the answer stopped (`stop`, for the error).

    Error messages describe the output's shape, never its text: the text may quote the email.
    """
    if len(inputs) != 1:
        raise PermanentError(
            f"unusable model output: {len(inputs)} calls of {TOOL_NAME} in {blocks} content "
            f"blocks ({stop})"
        )
    tool_input = inputs[0]
    if not isinstance(tool_input, dict):
        raise PermanentError(f"unusable model output: {TOOL_NAME} input is not an object")
    return tool_input


def usable_labels(
    tool_input: Mapping[str, Any], allowed: Sequence[str]
) -> tuple[tuple[LabelScore, ...], int]:
    """The usable label scores in the tool input, and how many entries were left out.

    An entry naming a label outside the configured ones, or without a confidence from 0 to 1, is
    dropped and counted rather than failing the answer: the email steers the model, so a hostile
    email could otherwise fail its own classification and escape the labels that fit it. The
    caller puts an email with dropped entries up for review. Keys the schema does not name are
    ignored; a label given twice keeps its highest confidence.
    """
    items = tool_input.get("labels")
    if not isinstance(items, list):
        raise PermanentError("unusable model output: 'labels' is not a list")
    scores: dict[str, float] = {}
    dropped = 0
    for item in items:
        if not _usable(item, allowed):
            dropped += 1
            continue
        label: str = item["label"]
        scores[label] = max(float(item["confidence"]), scores.get(label, 0.0))
    return tuple(LabelScore(label, confidence) for label, confidence in scores.items()), dropped


def _usable(item: object, allowed: Sequence[str]) -> bool:
    """An entry that names a configured label, with a confidence from 0 to 1."""
    if not isinstance(item, dict):
        return False
    confidence = item.get("confidence")
    return (
        item.get("label") in allowed
        and not isinstance(confidence, bool)
        and isinstance(confidence, int | float)
        and 0 <= confidence <= 1
    )
