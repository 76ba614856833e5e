from __future__ import annotations

import codecs
import email
import email.policy
import tracemalloc

import pytest

from mailpipe.errors import InputRejected
from mailpipe.mail.parse import (
    ParsedEmail,
    ParseLimits,
    _parse_bytes,
    header,
    looks_like_email,
    parse_email,
)
from mailpipe.mail.prescan import prescan
from mailpipe.mail.text import ALLOWED_CODECS, allowed_codec, decode_text, storable
from tests.support.corpus import CORPUS_EMAILS
from tests.support.emails import nested_multipart

LIMITS = ParseLimits(max_bytes=1 << 20, max_depth=25, max_parts=200, body_max_chars=10_000)


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
        # Found by the pre-scan at level 26, before the standard library recurses 1000 deep.
        (nested_multipart(1000), "nested deeper than 25"),
        (nested_multipart(40), "nested deeper than 25"),
    ],
)
def test_rejected_input_says_why(raw: bytes, reason: str) -> None:
    with pytest.raises(InputRejected, match=reason):
        parse_email(raw, LIMITS)


def test_limits_on_size_and_part_count() -> None:
    many = (
        b'From: a@example.org\r\nContent-Type: multipart/mixed; boundary="x"\r\n\r\n'
        + b"".join(b"--x\r\nContent-Type: text/plain\r\n\r\npart %d\r\n" % i for i in range(300))
        + b"--x--\r\n"
    )
    with pytest.raises(InputRejected, match="more than 200 MIME parts"):
        parse_email(many, LIMITS)
    with pytest.raises(InputRejected, match="over the limit"):
        parse_email(b"From: a@example.org\r\n\r\n" + b"x" * (2 << 20), LIMITS)


def test_header_that_makes_the_stdlib_raise_is_read_raw() -> None:
    # An address header the default policy cannot parse into an address list.
    raw = b'From: a@example.org\r\nTo: =?utf-8?b?////?= <@@@>, "unclosed\r\nSubject: ok\r\n\r\nbody'
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


def test_every_corpus_eml_parses_and_non_emails_are_rejected(parsed_corpus) -> None:
    emls = [file for file in parsed_corpus if file.path.suffix == ".eml"]
    assert len(emls) > 40
    for eml in emls:
        assert isinstance(eml.parsed, ParsedEmail), (eml.path, eml.parsed)
    by_name = {file.path.relative_to(CORPUS_EMAILS).as_posix(): file for file in parsed_corpus}
    for name in ("flanker/attachments/small.png", "flanker/LICENSE", "mail-parser/mail_outlook_1"):
        file = by_name[name]
        assert not looks_like_email(file.raw)
        assert isinstance(file.parsed, InputRejected) and "not an email" in str(file.parsed)


def test_every_corpus_email_parses_and_the_pre_scan_counts_as_the_parser_does(
    parsed_corpus,
) -> None:
    # Every file that reads as an email, with or without a .eml name.
    emails = [file for file in parsed_corpus if looks_like_email(file.raw)]
    assert len(emails) >= 140
    for email_file in emails:
        parsed = email_file.parsed
        assert isinstance(parsed, ParsedEmail), (email_file.path, parsed)
        scan = prescan(email_file.raw, max_parts=1000, max_depth=25)
        built = _count_entities(_parse_bytes(scan.raw, 1000))
        assert (scan.parts, scan.parsed_parts) == (parsed.part_count, built), email_file.path


def _count_entities(message: email.message.Message) -> int:
    payload = message.get_payload()
    children = payload if isinstance(payload, list) else []
    return 1 + sum(_count_entities(child) for child in children)


@pytest.mark.parametrize(
    ("name", "subject", "sender", "attachments"),
    [
        # Two multiparts with the same boundary, a boundary that is never used, a broken
        # Content-Type, a Content-Transfer-Encoding on a multipart, 8-bit headers.
        ("mail-parser/mail_malformed_1", "immagine", "femucca@tin.it", 1),
        ("mail-parser/mail_malformed_2", "Delivery failure (abh@netpar.com.br)", None, 2),
        ("mail-parser/mail_malformed_3", "Ahorre Dinero en su Recibo de Luz", None, 0),
        (
            "flanker/mailformed-headers.eml",
            "\ufffd!",
            "Юникод запрещен\ufffd <headers@gmail.com>",
            0,
        ),
        ("flanker/spam/broken-headers.eml", "Forget Asking For A Link Exchange\ufffd", None, 0),
        ("flanker/spam/broken-ctype.eml", "its me A", "A <hello@example.com>", 1),
    ],
)
def test_corpus_emails_with_malformed_headers_still_parse(
    name: str, subject: str, sender: str | None, attachments: int
) -> None:
    parsed = parse_email((CORPUS_EMAILS / name).read_bytes(), LIMITS)
    assert parsed.subject == subject
    if sender is not None:
        assert parsed.sender == sender
    assert len(parsed.attachments) == attachments
    assert [a.index for a in parsed.attachments] == list(range(attachments))


def test_every_allowed_codec_is_a_codec_and_resolves_to_itself() -> None:
    for name in ALLOWED_CODECS:
        assert allowed_codec(name) == name
        assert allowed_codec(codecs.lookup(name).name) == name


@pytest.mark.parametrize(
    "label",
    [
        "UTF-8",
        "utf8",
        '"iso-8859-1"',
        "Windows-1252",
        "us-ascii",
        "ks_c_5601-1987",
        "ISO-2022-JP",
        "Shift_JIS",
        "gb2312",
        "koi8-r",
        "latin1",
    ],
)
def test_charset_labels_of_real_mail_resolve_as_codecs_lookup_does(label: str) -> None:
    codec = allowed_codec(label)
    assert codec is not None
    assert codecs.lookup(codec).name == codecs.lookup(label.strip('"')).name


@pytest.mark.parametrize(
    "label",
    [
        "utf-7",
        "UTF7",
        "punycode",
        "idna",
        "unicode_escape",
        "raw-unicode-escape",
        "base64",
        "zlib",
        "rot13",
        "undefined",
        "x-unknown",
        "encodings.aliases",
        "",
    ],
)
def test_charsets_not_allowed(label: str) -> None:
    assert allowed_codec(label) is None


def test_text_in_a_charset_not_allowed_falls_back() -> None:
    assert decode_text(b"+ADw-b+AD4-", "utf-7") == "+ADw-b+AD4-"
    assert decode_text("caf\u00e9".encode(), "punycode") == "caf\u00e9"
    assert decode_text("caf\u00e9".encode("cp1252"), "windows-1252") == "caf\u00e9"
    assert decode_text(b"\xff\xfe\xfd", "no-such-charset").encode("utf-8")


def test_storable_text_has_no_nul_and_no_lone_surrogate() -> None:
    assert storable("plain") == "plain"
    assert storable("a\x00b") == "ab"
    assert storable(b"caf\xc3\xa9 \xff".decode("ascii", "surrogateescape")) == "café \ufffd"
    assert storable("x\ud800y\udfffz") == "x\ufffdy\ufffdz"
