"""The prompt builder, called directly: what of an email's headers reaches the model."""

from __future__ import annotations

import re

from mailpipe.classifiers import EmailForClassifier, input_as_json, input_from_json
from mailpipe.classifiers.prompt import MAX_RECIPIENTS, MIN_TEXT_BUDGET, Prompt, build_prompt
from mailpipe.settings import DEFAULT_LABELS


def email_to(recipients: tuple[str, ...], more_recipients: int = 0) -> EmailForClassifier:
    return EmailForClassifier(
        subject="Quarterly results",
        sender="ir@example.com",
        recipients=recipients,
        date="Mon, 30 Nov 2026 09:00:00 +0000",
        body_text="See the figures below.",
        more_recipients=more_recipients,
    )


def to_line(prompt: Prompt) -> str:
    [line] = [line for line in prompt.user.splitlines() if line.startswith("To: ")]
    return line


def test_500_recipients_are_listed_up_to_the_cap_and_counted_outside_the_fence() -> None:
    recipients = tuple(f"person{n}@example.org" for n in range(500))

    prompt = build_prompt(email_to(recipients), DEFAULT_LABELS, 24_000)

    listed = to_line(prompt).removeprefix("To: ").split(", ")
    assert 0 < len(listed) <= MAX_RECIPIENTS
    assert listed == list(recipients[: len(listed)])  # the first ones, in order
    note = f"To lists the first {len(listed)} of its 500 recipients:"
    fence = f"<<<EMAIL_DATA {prompt.nonce}"
    assert note in prompt.user
    assert prompt.user.index(note) < prompt.user.index(fence)  # stated by the system
    assert "person499@" not in prompt.user
    assert prompt.truncated


def test_each_recipient_is_cut_short_and_the_line_stays_bounded() -> None:
    recipients = ("a" * 5000 + "@example.org", "\n".join(["b@example.org", "From: ceo@x"]), "c@x")

    line = to_line(build_prompt(email_to(recipients * 100), DEFAULT_LABELS, MIN_TEXT_BUDGET))

    first, second, *_ = line.removeprefix("To: ").split(", ")
    assert first == "a" * 99 + "…"
    assert second == "b@example.org From: ceo@x"  # one line: no forged header
    assert len(line) <= len("To: ") + 300


def test_recipients_the_cpu_stage_left_out_are_counted() -> None:
    kept = email_to(tuple(f"p{n}@example.org" for n in range(MAX_RECIPIENTS)), 480)

    prompt = build_prompt(input_from_json(input_as_json(kept)), DEFAULT_LABELS, 24_000)

    listed = to_line(prompt).removeprefix("To: ").split(", ")
    assert f"To lists the first {len(listed)} of its 500 recipients:" in prompt.user


def test_input_kept_before_the_cap_reads_as_complete() -> None:
    kept = input_as_json(email_to(("a@example.org",)))
    del kept["more_recipients"]  # what the CPU stage kept before the count existed

    assert input_from_json(kept).more_recipients == 0


def test_a_short_list_is_whole_and_not_called_shortened() -> None:
    prompt = build_prompt(email_to(("a@example.org", "b@example.org")), DEFAULT_LABELS, 24_000)

    assert to_line(prompt) == "To: a@example.org, b@example.org"
    assert re.search(r"The email's headers and body:\n<<<EMAIL_DATA", prompt.user)
    assert not prompt.truncated
