"""Classifiers: what an email is about, as labels from the configured label set.

Two interchangeable backends behind one small interface, chosen by ``MAILPIPE_MODEL_BACKEND``:
``rules`` (local keyword, regex and sender rules) and ``bedrock`` (Amazon Bedrock ``converse``).
A classifier raises `mailpipe.errors.Throttled` when throttled, `mailpipe.errors.ModelUnavailable`
for outages, `mailpipe.errors.ModelAccessDenied` for credentials, permissions or a model it cannot
use, and `mailpipe.errors.PermanentError` for input or output it cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mailpipe.settings import Settings


@dataclass(frozen=True)
class DocumentText:
    """The converted text of one attachment."""

    filename: str
    content_type: str
    text: str


@dataclass(frozen=True)
class EmailForClassifier:
    """What a classifier may read of an email. Every field is untrusted text from a stranger."""

    subject: str
    sender: str
    recipients: tuple[str, ...]
    date: str | None
    body_text: str
    documents: tuple[DocumentText, ...] = ()
    # Recipients left out of `recipients` when it was built (the CPU stage keeps the first
    # `prompt.MAX_RECIPIENTS`), so that the prompt can say how many there are in all.
    more_recipients: int = 0


def input_as_json(email: EmailForClassifier) -> dict[str, Any]:
    """What the classification stage reads, as stored between the stages."""
    return {
        "subject": email.subject,
        "sender": email.sender,
        "recipients": list(email.recipients),
        "date": email.date,
        "body_text": email.body_text,
        "documents": [[d.filename, d.content_type, d.text] for d in email.documents],
        "more_recipients": email.more_recipients,
    }


def input_from_json(data: dict[str, Any]) -> EmailForClassifier:
    return EmailForClassifier(
        subject=data["subject"],
        sender=data["sender"],
        recipients=tuple(data["recipients"]),
        date=data["date"],
        body_text=data["body_text"],
        documents=tuple(DocumentText(*document) for document in data["documents"]),
        # Absent from what was kept before the recipients were capped: those kept them all.
        more_recipients=data.get("more_recipients", 0),
    )


@dataclass(frozen=True)
class LabelScore:
    label: str
    confidence: float


@dataclass(frozen=True)
class ClassificationResult:
    labels: tuple[LabelScore, ...]
    model_id: str
    prompt_version: str
    output: dict[str, Any] = field(default_factory=dict)
    input_tokens: int | None = None
    output_tokens: int | None = None
    latency_ms: int = 0
    # Entries of the answer left out of `labels` (a label outside MAILPIPE_LABELS, a confidence
    # outside 0 to 1): the email is put up for review when its classification is stored.
    dropped_labels: int = 0


class Classifier(Protocol):
    model_id: str
    remote: bool  # True: calls a paid provider, so every call takes a fleet-wide rate-limit slot

    def classify(self, email: EmailForClassifier) -> ClassificationResult: ...

    def check(self) -> None:
        """The cheapest call that proves the fleet may use the model; raises as `classify`."""
        ...


def make_classifier(settings: Settings) -> Classifier:
    """The backend the settings name."""
    if settings.model_backend == "bedrock":
        from mailpipe.classifiers.bedrock import BedrockClassifier

        return BedrockClassifier.from_settings(settings)
    from mailpipe.classifiers.rules import RulesClassifier

    return RulesClassifier.from_settings(settings)
