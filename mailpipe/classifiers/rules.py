"""The `rules` classifier: local keyword, regex and sender rules from a TOML file.

Free, fast and deterministic: what the demo, the tests and the benchmarks use, and a fallback when
no model may be called. It never leaves the process, so it takes no rate-limit slot.
"""

from __future__ import annotations

import re
import time
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mailpipe.classifiers import ClassificationResult, EmailForClassifier, LabelScore
from mailpipe.settings import Settings

DEFAULT_RULES = "default_rules.toml"


@dataclass(frozen=True)
class Rule:
    label: str
    confidence: float
    keywords: re.Pattern[str] | None
    patterns: tuple[re.Pattern[str], ...]
    sender_patterns: tuple[re.Pattern[str], ...]
    content_types: frozenset[str]


class RulesClassifier:
    remote = False

    def __init__(self, rules: list[Rule], version: str) -> None:
        self.rules = rules
        self.model_id = "rules"
        self.prompt_version = version

    @classmethod
    def from_settings(cls, settings: Settings) -> RulesClassifier:
        if settings.rules_file is not None:
            source = Path(settings.rules_file).read_text(encoding="utf-8")
        else:
            source = (
                resources.files("mailpipe.classifiers").joinpath(DEFAULT_RULES).read_text("utf-8")
            )
        return cls.from_toml(source, allowed_labels=settings.labels)

    @classmethod
    def from_toml(cls, source: str, allowed_labels: tuple[str, ...]) -> RulesClassifier:
        data = tomllib.loads(source)
        rules = []
        for entry in data.get("rule", []):
            label = entry["label"]
            if label not in allowed_labels:
                raise ValueError(f"rules file names label {label!r}, not in MAILPIPE_LABELS")
            keywords = entry.get("keywords", [])
            rules.append(
                Rule(
                    label=label,
                    confidence=float(entry.get("confidence", 0.5)),
                    keywords=re.compile(
                        r"(?<!\w)(" + "|".join(re.escape(k) for k in keywords) + r")(?!\w)",
                        re.IGNORECASE,
                    )
                    if keywords
                    else None,
                    patterns=tuple(re.compile(p) for p in entry.get("patterns", [])),
                    sender_patterns=tuple(re.compile(p) for p in entry.get("sender_patterns", [])),
                    content_types=frozenset(entry.get("content_types", [])),
                )
            )
        return cls(rules, str(data.get("version", "unversioned")))

    def check(self) -> None:
        """Rules are read at start: there is nothing to call."""

    def classify(self, email: EmailForClassifier) -> ClassificationResult:
        started = time.perf_counter()
        text = "\n".join([email.subject, email.body_text, *(d.text for d in email.documents)])
        content_types = {d.content_type for d in email.documents}
        matched: dict[str, list[str]] = {}
        confidence: dict[str, float] = {}
        for rule in self.rules:
            reasons = _reasons(rule, text, email.sender, content_types)
            if reasons:
                matched.setdefault(rule.label, []).extend(reasons)
                confidence[rule.label] = max(confidence.get(rule.label, 0.0), rule.confidence)
        return ClassificationResult(
            labels=tuple(LabelScore(label, score) for label, score in confidence.items()),
            model_id=self.model_id,
            prompt_version=self.prompt_version,
            output={"matched": matched},
            latency_ms=int((time.perf_counter() - started) * 1000),
        )


def _reasons(rule: Rule, text: str, sender: str, content_types: set[str]) -> list[str]:
    reasons = []
    if rule.keywords is not None and (found := rule.keywords.search(text)):
        reasons.append(f"keyword {found.group(1).lower()!r}")
    reasons.extend(f"pattern {p.pattern!r}" for p in rule.patterns if p.search(text))
    reasons.extend(f"sender {p.pattern!r}" for p in rule.sender_patterns if p.search(sender))
    reasons.extend(f"content type {t}" for t in sorted(rule.content_types & content_types))
    return reasons
