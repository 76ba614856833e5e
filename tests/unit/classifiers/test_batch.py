"""The records of a model batch and their answers, with no service: what a record's
`modelInput` holds, and how a record's `modelOutput` is read (mailpipe/classifiers/batch.py)."""

from __future__ import annotations

from typing import Any

import pytest

from mailpipe.classifiers import EmailForClassifier
from mailpipe.classifiers.batch import ANTHROPIC_VERSION, BatchModel, job_id
from mailpipe.classifiers.prompt import PROMPT_VERSION, TOOL_NAME, tool_config
from mailpipe.errors import PermanentError
from mailpipe.settings import DEFAULT_LABELS, Settings

EMAIL = EmailForClassifier(
    subject="Invoice 42",
    sender="billing@example.com",
    recipients=("a@example.org",),
    date=None,
    body_text="The amount due is 12 EUR.",
)


@pytest.fixture
def model() -> BatchModel:
    return BatchModel.from_settings(
        Settings(model_backend="bedrock", model_batch_role_arn="arn:aws:iam::1:role/batch")
    )


def answer(*blocks: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "role": "assistant",
        "content": list(blocks),
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 900, "output_tokens": 30} if usage is None else usage,
    }


def tool_use(labels: list[dict[str, Any]], name: str = TOOL_NAME) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_1", "name": name, "input": {"labels": labels}}


def test_a_record_is_the_converse_call_s_prompt_and_forced_tool_as_an_invokemodel_body(
    model: BatchModel,
) -> None:
    body = model.model_input(EMAIL)
    assert body["anthropic_version"] == ANTHROPIC_VERSION
    assert body["temperature"] == 0
    assert body["tool_choice"] == {"type": "tool", "name": TOOL_NAME}
    [tool] = body["tools"]
    spec = tool_config(DEFAULT_LABELS)["tools"][0]["toolSpec"]
    assert tool == {
        "name": spec["name"],
        "description": spec["description"],
        "input_schema": spec["inputSchema"]["json"],
    }
    [message] = body["messages"]
    [text] = message["content"]
    assert message["role"] == "user" and text["type"] == "text"
    assert "The amount due is 12 EUR." in text["text"]
    assert "<<<EMAIL_DATA " in text["text"] and "EMAIL_DATA" in body["system"]


def test_an_answer_is_read_as_a_converse_answer_with_its_tokens(model: BatchModel) -> None:
    result = model.result(
        answer(
            {"type": "text", "text": "here"},
            tool_use(
                [
                    {"label": "invoice", "confidence": 0.9},
                    {"label": "not-a-label", "confidence": 0.9},
                    {"label": "spam", "confidence": 7},
                ]
            ),
        )
    )
    assert [(score.label, score.confidence) for score in result.labels] == [("invoice", 0.9)]
    assert result.dropped_labels == 2
    assert (result.input_tokens, result.output_tokens) == (900, 30)
    assert (result.model_id, result.prompt_version) == (model.model_id, PROMPT_VERSION)


def test_an_answer_without_one_call_of_the_tool_is_unusable_and_names_no_text(
    model: BatchModel,
) -> None:
    with pytest.raises(PermanentError, match="0 calls of record_labels in 1 content blocks"):
        model.result(answer({"type": "text", "text": "secret words from the email"}))
    with pytest.raises(PermanentError, match="input is not an object"):
        model.result(answer({"type": "tool_use", "name": TOOL_NAME, "input": "labels"}))
    with pytest.raises(PermanentError) as raised:
        model.result(answer(tool_use([]), tool_use([])))
    assert "secret" not in str(raised.value)


def test_tokens_that_are_not_counts_are_not_kept(model: BatchModel) -> None:
    result = model.result(answer(tool_use([]), usage={"input_tokens": "9", "output_tokens": True}))
    assert (result.input_tokens, result.output_tokens) == (None, None)


def test_a_job_s_id_is_the_last_part_of_its_arn() -> None:
    arn = "arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/abcdef123456"
    assert job_id(arn) == "abcdef123456"
