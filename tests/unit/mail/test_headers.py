"""`headers.plain_value` gives what the default policy gives, or leaves the value to it."""

from __future__ import annotations

import email.parser
import email.policy
import string
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mailpipe.mail import headers, parse
from mailpipe.mail.parse import ParseLimits, parse_email
from tests.support.corpus import CORPUS_LIMITS, CorpusFile

LIMITS = ParseLimits(max_bytes=1 << 24, max_depth=25, max_parts=500, body_max_chars=100_000)
NAMES = ("Subject", "From", "To", "Cc", "Message-ID", "Date")
# The same examples on every run, and nothing written to the working tree.
CHECKED = settings(deadline=None, derandomize=True, database=None)


def policy_value(name: str, raw: str) -> str:
    """What the default policy reads from the raw value, as `Message.get` does."""
    return str(email.policy.default.header_fetch_parse(name, raw))


def assert_agrees(name: str, raw: str) -> None:
    plain = headers.plain_value(name, raw)
    if plain is not None:
        assert plain == policy_value(name, raw), (name, raw)


# Pieces of header values, plain and not: words, specials, white space, folds, encoded words,
# comments, quotes, 8-bit bytes (as the parser keeps them: surrogates), control characters.
PIECES = st.sampled_from(
    [
        "Ann",
        "b",
        "O'Neil",
        "x_y",
        "+1",
        "{}",
        "*",
        "#",
        "@",
        ".",
        ",",
        ";",
        ":",
        "<",
        ">",
        '"',
        "(",
        ")",
        "[",
        "]",
        "\\",
        " ",
        "  ",
        "\t",
        "\r\n ",
        "\n\t",
        "=?",
        "?=",
        "=?utf-8?q?Gr=C3=BC=C3=9Fe?=",
        "=?iso-8859-1?b?4Q==?=",
        "\udcc3\udca9",
        "\x01",
        "\x7f",
        "é",
    ]
)
ATOMS = st.text(
    string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~-", min_size=1, max_size=6
)
DOT_ATOMS = st.lists(ATOMS, min_size=1, max_size=3).map(".".join)
ADDRESSES = st.builds("{}@{}".format, DOT_ATOMS, DOT_ATOMS)
NAMED = st.builds(
    "{}{}<{}>".format,
    st.lists(ATOMS, min_size=1, max_size=3).map(" ".join),
    st.sampled_from(["", " ", "  ", "\t"]),
    ADDRESSES,
)
MAILBOX_LISTS = st.lists(st.one_of(ADDRESSES, NAMED), min_size=1, max_size=4).flatmap(
    lambda boxes: st.sampled_from([",", ", ", " ,  ", ",\r\n "]).map(lambda sep: sep.join(boxes))
)
# A plain value with a piece put in somewhere: mostly no longer plain, sometimes still.
NEAR_MISSES = st.tuples(MAILBOX_LISTS, PIECES, st.integers(min_value=0, max_value=60)).map(
    lambda t: t[0][: t[2]] + t[1] + t[0][t[2] :]
)
DATES = st.builds(
    lambda when, offset, shape: shape(when.replace(tzinfo=timezone(timedelta(minutes=offset)))),
    st.datetimes(min_value=datetime(1900, 1, 1), max_value=datetime(2100, 1, 1)),
    st.integers(min_value=-14 * 60, max_value=14 * 60),
    st.sampled_from(
        [
            format_datetime,
            lambda d: d.strftime("%a, %d %b %Y %H:%M:%S %z"),
            lambda d: d.strftime("%d %b %Y %H:%M %z"),
            lambda d: d.strftime("%a, %d %b %y %H:%M:%S GMT"),
            lambda d: d.strftime("%A, %d %B %Y %H:%M:%S (%Z)"),
            lambda d: d.strftime("%Y-%m-%d %H:%M:%S"),
        ]
    ),
)


@settings(CHECKED, max_examples=1000)
@given(st.sampled_from(NAMES), st.lists(PIECES, max_size=12).map("".join))
def test_any_value_agrees_or_is_left_to_the_policy(name: str, raw: str) -> None:
    assert_agrees(name, raw)


@settings(CHECKED, max_examples=600)
@given(st.sampled_from(("From", "To", "Cc")), st.one_of(MAILBOX_LISTS, NEAR_MISSES))
def test_address_lists_agree(name: str, raw: str) -> None:
    assert_agrees(name, raw)


@settings(CHECKED, max_examples=400)
@given(st.one_of(DATES, DATES.map(lambda d: d.replace(" ", "  ", 1)), st.text(max_size=40)))
def test_dates_agree(raw: str) -> None:
    assert_agrees("Date", raw)


@settings(CHECKED, max_examples=400)
@given(
    st.one_of(
        st.builds("<{}@{}>".format, DOT_ATOMS, DOT_ATOMS),
        st.builds("<{}@{}>{}".format, DOT_ATOMS, DOT_ATOMS, PIECES),
        st.lists(PIECES, max_size=8).map("".join),
    )
)
def test_message_ids_agree(raw: str) -> None:
    assert_agrees("Message-ID", raw)


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("Subject", "Re: project 0", "Re: project 0"),
        ("Subject", "a\r\n long\tone", "a long\tone"),
        ("From", "Sender 0 <sender0@example0.com>", "Sender 0 <sender0@example0.com>"),
        ("From", "Ann  Lee\t<ann.lee@example.org>", "Ann Lee <ann.lee@example.org>"),
        ("To", "a@x.example,b@y.example", "a@x.example, b@y.example"),
        ("Message-ID", "<plain-0@bench.mailpipe.example>", "<plain-0@bench.mailpipe.example>"),
        ("Date", "Fri, 1 Mar 2024 9:00:00 +0000", "Fri, 01 Mar 2024 09:00:00 +0000"),
    ],
)
def test_plain_values_are_read_without_the_policy(name: str, raw: str, expected: str) -> None:
    assert headers.plain_value(name, raw) == expected == policy_value(name, raw)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("Subject", "=?utf-8?q?Gr=C3=BC=C3=9Fe?="),
        ("Subject", "caf\udcc3\udca9"),
        ("From", '"Lee, Ann" <ann@example.org>'),
        ("From", "A.B <ab@example.org>"),
        ("From", "ann@example.org (Ann)"),
        ("To", "undisclosed-recipients:;"),
        ("To", "a@example.org,"),
        ("Message-ID", "<a@b> <c@d>"),
        ("Date", "not a date"),
        ("Content-Type", "text/plain"),
    ],
)
def test_other_values_are_left_to_the_policy(name: str, raw: str) -> None:
    assert headers.plain_value(name, raw) is None


def test_corpus_emails_parse_the_same_with_and_without_plain_values(
    parsed_corpus: list[CorpusFile], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every field of every parsed corpus email, and how many headers took the plain path."""
    with monkeypatch.context() as patched:
        patched.setattr(parse, "plain_value", lambda name, raw: None)
        for file in parsed_corpus:
            try:
                again: object = parse_email(file.raw, CORPUS_LIMITS)
            except Exception as exc:  # an email the parser rejects must be rejected alike
                again = exc
            assert _compared(again) == _compared(file.parsed), file.path.name
    plain_read = sum(
        headers.plain_value(name, value) is not None
        for file in parsed_corpus
        if not isinstance(file.parsed, Exception)
        for name, value in _top_headers(file.raw)
    )
    # The corpus is real mail: its emails must still average more than one header read plainly.
    assert plain_read > len(parsed_corpus)


def _compared(outcome: object) -> object:
    return repr(outcome) if isinstance(outcome, Exception) else outcome


def _top_headers(raw: bytes) -> list[tuple[str, str]]:
    message = email.parser.BytesHeaderParser(policy=email.policy.default).parsebytes(raw)
    return [(k, v) for k, v in message.raw_items() if k in NAMES]


def test_a_plain_email_reads_every_header_plainly() -> None:
    raw = (
        b"From: Sender 0 <sender0@example0.com>\r\nTo: team0@mailpipe.example\r\n"
        b"Subject: Re: project 0\r\nDate: Fri, 01 Mar 2024 09:00:00 +0000\r\n"
        b"Message-ID: <plain-0@bench.mailpipe.example>\r\n\r\nHello\r\n"
    )
    read = [name for name, value in _top_headers(raw) if headers.plain_value(name, value)]
    assert sorted(read) == sorted(["From", "To", "Subject", "Date", "Message-ID"])
    parsed = parse_email(raw, LIMITS)
    assert parsed.sender == "Sender 0 <sender0@example0.com>"
    assert parsed.recipients == ("team0@mailpipe.example",)
    assert parsed.subject == "Re: project 0"
    assert parsed.date == "Fri, 01 Mar 2024 09:00:00 +0000"
    assert parsed.message_id == "plain-0@bench.mailpipe.example"
    assert parsed.body_text.strip() == "Hello"
