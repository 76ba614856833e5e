from __future__ import annotations

import pytest

from mailpipe.classifiers import DocumentText, EmailForClassifier
from mailpipe.classifiers.rules import RulesClassifier
from mailpipe.settings import Settings


def classify(subject: str, body: str, sender: str = "a@example.org", docs=()):  # type: ignore[no-untyped-def]
    classifier = RulesClassifier.from_settings(Settings())
    return classifier.classify(EmailForClassifier(subject, sender, (), None, body, tuple(docs)))


def test_default_rules_label_by_keyword_sender_and_content_type() -> None:
    assert {s.label for s in classify("Invoice 12", "amount due: 10").labels} == {"invoice"}
    bounce = classify("Undeliverable: hi", "x", sender="MAILER-DAEMON@mx.example.org")
    assert "bounce" in {s.label for s in bounce.labels}
    ics = classify("hi", "x", docs=[DocumentText("a.ics", "text/calendar", "BEGIN:VCALENDAR")])
    assert "calendar" in {s.label for s in ics.labels}
    assert classify("Lunch?", "see you at noon").labels == ()


def test_keywords_match_whole_words_only() -> None:
    assert classify("receipts", "preinvoiced").labels == ()


def test_result_records_model_version_and_reasons() -> None:
    result = classify("Password reset", "reset your password here")
    assert result.model_id == "rules"
    assert result.prompt_version.startswith("default-")
    assert "security" in result.output["matched"]


def test_rules_file_may_only_name_configured_labels() -> None:
    with pytest.raises(ValueError, match="not in MAILPIPE_LABELS"):
        RulesClassifier.from_toml('[[rule]]\nlabel = "nope"\nkeywords = ["x"]\n', ("invoice",))
