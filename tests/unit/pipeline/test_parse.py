from __future__ import annotations

import email
import email.policy
import tracemalloc
from pathlib import Path

import pytest

from mailpipe.errors import InputRejected
from mailpipe.pipeline.parse import ParseLimits, header, looks_like_email, parse_email

LIMITS = ParseLimits(max_bytes=1 << 20, max_depth=25, max_parts=200, body_max_chars=10_000)
CORPUS_EMAILS = Path(__file__).resolve().parents[4] / "shared" / "corpus" / "emails"


def nested_multipart(levels: int) -> bytes:
    head = b"".join(
        b'Content-Type: multipart/mixed; boundary="b%d"\r\n\r\n--b%d\r\n' % (i, i) for i in range(levels)
    )
    tail = b"".join(b"\r\n--b%d--\r\n" % i for i in reversed(range(levels)))
    return b"From: a@example.org\r\nSubject: deep\r\n" + head + b"Content-Type: text/plain\r\n\r\nhi" + tail


def test_plain_email_headers_and_body() -> None:
    raw = (
        b"From: Ann <ann@example.org>\r\nTo: bob@example.org, Cy <cy@example.org>\r\n"
        b"Subject: =?utf-8?q?Gr=C3=BC=C3=9Fe?=\r\nMessage-ID: < ABC@Example.org >\r\n\r\nHello\r\n"
    )
    parsed = parse_email(raw, LIMITS)
    assert parsed.subject == "Grüße"
    assert parsed.message_id == "abc@example.org"
    assert parsed.recipients == ("bob@example.org", "cy@example.org")
    assert parsed.body_text.strip() == "Hello"
    assert parsed.attachments == ()


def test_html_only_body_becomes_text_without_script() -> None:
    raw = (
        b"From: a@example.org\r\nContent-Type: text/html\r\n\r\n"
        b"<html><script>steal()</script><p>Visible <b>words</b></p><img src='http://x/y.gif'></html>"
    )
    parsed = parse_email(raw, LIMITS)
    assert "Visible" in parsed.body_text and "words" in parsed.body_text
    assert "steal" not in parsed.body_text


def test_attachment_and_wrong_charset_fallback() -> None:
    raw = (
        b'From: a@example.org\r\nContent-Type: multipart/mixed; boundary="x"\r\n\r\n'
        b"--x\r\nContent-Type: text/plain; charset=no-such-charset\r\n\r\ncaf\xc3\xa9\r\n"
        b'--x\r\nContent-Type: application/pdf\r\nContent-Disposition: attachment; filename="../../etc/passwd"\r\n'
        b"Content-Transfer-Encoding: base64\r\n\r\nJVBERi0xLjQK\r\n--x--\r\n"
    )
    parsed = parse_email(raw, LIMITS)
    assert parsed.body_text.strip() == "café"
    [attachment] = parsed.attachments
    assert attachment.content_type == "application/pdf"
    assert attachment.payload.startswith(b"%PDF-1.4")
    assert attachment.filename == "../../etc/passwd"  # raw and untrusted; documents sanitise it


def test_attached_email_is_one_attachment_with_its_bytes() -> None:
    raw = (
        b'From: a@example.org\r\nContent-Type: multipart/mixed; boundary="x"\r\n\r\n'
        b"--x\r\nContent-Type: text/plain\r\n\r\nsee attached\r\n"
        b"--x\r\nContent-Type: message/rfc822\r\n\r\nFrom: inner@example.org\r\nSubject: inner\r\n\r\ninner body\r\n"
        b"--x--\r\n"
    )
    parsed = parse_email(raw, LIMITS)
    [attachment] = parsed.attachments
    assert attachment.content_type == "message/rfc822"
    assert b"Subject: inner" in attachment.payload


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "empty"),
        (b"   \r\n", "empty"),
        (b"\x89PNG\r\n\x1a\n binary junk", "not an email"),
        (nested_multipart(1000), "nested too deeply"),
        (nested_multipart(40), "nested deeper than 25"),
    ],
)
def test_rejected_input_says_why(raw: bytes, reason: str) -> None:
    with pytest.raises(InputRejected, match=reason):
        parse_email(raw, LIMITS)


def test_limits_on_size_and_part_count() -> None:
    many = b'From: a@example.org\r\nContent-Type: multipart/mixed; boundary="x"\r\n\r\n' + b"".join(
        b"--x\r\nContent-Type: text/plain\r\n\r\npart %d\r\n" % i for i in range(300)
    ) + b"--x--\r\n"
    with pytest.raises(InputRejected, match="more than 200 MIME parts"):
        parse_email(many, LIMITS)
    with pytest.raises(InputRejected, match="over the limit"):
        parse_email(b"From: a@example.org\r\n\r\n" + b"x" * (2 << 20), LIMITS)


def test_header_that_makes_the_stdlib_raise_is_read_raw() -> None:
    # An address header the default policy cannot parse into an address list.
    raw = b"From: a@example.org\r\nTo: =?utf-8?b?////?= <@@@>, \"unclosed\r\nSubject: ok\r\n\r\nbody"
    message = email.message_from_bytes(raw, policy=email.policy.default)
    assert isinstance(header(message, "To"), str)
    parsed = parse_email(raw, LIMITS)
    assert parsed.subject == "ok"


def test_a_very_long_header_is_decoded_without_the_policy_parser() -> None:
    # As in a corpus email with a 200 KB Subject: the default policy's parser took 350 MB for it.
    words = " ".join(["=?utf-8?q?hei=C3=9Fe_Sonne?="] * 8000)
    raw = f"From: a@example.org\r\nSubject: {words}\r\n\r\nbody".encode()
    tracemalloc.start()
    try:
        parsed = parse_email(raw, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed.subject.startswith("heiße Sonne") and parsed.subject.count("Sonne") == 8000
    assert peak < 20 << 20


def test_every_corpus_eml_parses_and_non_emails_are_rejected() -> None:
    limits = ParseLimits(50 << 20, 25, 1000, 200_000)
    emls = sorted(CORPUS_EMAILS.rglob("*.eml"))
    assert len(emls) > 40
    for path in emls:
        parse_email(path.read_bytes(), limits)
    for name in ("flanker/attachments/small.png", "flanker/LICENSE", "mail-parser/mail_outlook_1"):
        raw = (CORPUS_EMAILS / name).read_bytes()
        assert not looks_like_email(raw)
        with pytest.raises(InputRejected, match="not an email"):
            parse_email(raw, limits)
