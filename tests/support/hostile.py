"""Hostile emails: each built to cost a parser time or memory, or to trip it up, and a few
references. The bench (bench/hostile.py) measures them; the worker test of stored errors
(tests/integration/test_no_email_content.py) runs them, so both see the same inputs."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable

from tests.support.paths import CORPUS

CORPUS_EMAILS = CORPUS / "emails"
HEAD = b"From: a@example.org\r\nTo: b@example.org\r\nSubject: hostile\r\n"


def many_parts() -> bytes:
    """400,000 empty parts in 2 MB (the issue: 22.9 s and 249 MB)."""
    return HEAD + b'Content-Type: multipart/mixed; boundary="x"\r\n\r\n' + b"--x\n\n" * 400_000


def many_params() -> bytes:
    """A Content-Type with 40,000 parameters, 389 KB (the issue: 22.4 s and 322 MB)."""
    params = b"".join(b"; p%d=v" % i for i in range(40_000))
    return HEAD + b"Content-Type: text/plain" + params + b"\r\n\r\nbody"


def punycode_body() -> bytes:
    """A 600 KB body declared charset=punycode (the issue: 10.4 s, quadratic)."""
    return HEAD + b"Content-Type: text/plain; charset=punycode\r\n\r\nab-" + b"ba" * 300_000


def long_8bit_subject() -> bytes:
    """A 5 KB Subject with a raw 8-bit byte (the issue: UnicodeEncodeError when stored)."""
    return b"From: a@example.org\r\nSubject: caf\xe9 " + b"x" * 5000 + b"\r\n\r\nbody"


def malformed_line() -> bytes:
    """A header block with a line without a colon before From (the issue: "not an email")."""
    return (
        b"Received: from x by y\r\nX-Garbage line without colon\r\nFrom: a@example.org\r\n"
        b"Subject: kept\r\n\r\nbody\r\n"
    )


def garbled_first_line() -> bytes:
    return b"\xff\xfe garbage\r\nFrom: a@example.org\r\nSubject: kept\r\n\r\nbody\r\n"


def many_lines() -> bytes:
    """4 million short lines, 8 MB: the parser keeps a string per line."""
    return HEAD + b"\r\n" + b"a\n" * 4_000_000


def many_headers() -> bytes:
    """400,000 header fields, 2.8 MB."""
    return HEAD + b"X-A: b\n" * 400_000 + b"\nbody"


def delivery_status() -> bytes:
    """A message/delivery-status of 400,000 header blocks: one object per block."""
    return HEAD + b"Content-Type: message/delivery-status\r\n\r\n" + b"A: b\n\n" * 400_000


def nested_multipart(levels: int) -> bytes:
    head = b"".join(
        b'Content-Type: multipart/mixed; boundary="b%d"\r\n\r\n--b%d\r\n' % (i, i)
        for i in range(levels)
    )
    tail = b"".join(b"\r\n--b%d--\r\n" % i for i in reversed(range(levels)))
    return HEAD + head + b"Content-Type: text/plain\r\n\r\nhi" + tail


def nested_email(levels: int) -> bytes:
    message = b"From: l%d@example.com\r\nSubject: level %d\r\n\r\nbody\r\n" % (levels, levels)
    for level in range(levels - 1, 0, -1):
        message = (
            b"From: l%d@example.com\r\nSubject: level %d\r\n"
            b'Content-Type: multipart/mixed; boundary="b%d"\r\n\r\n'
            b"--b%d\r\nContent-Type: message/rfc822\r\n\r\n%s\r\n--b%d--\r\n"
        ) % (level, level, level, level, message, level)
    return message


def deep_with_lines() -> bytes:
    """25 nested multiparts (the most allowed) around 900,000 short lines (under the limit): what
    a hostile email within every limit still costs."""
    return nested_multipart(25).replace(b"\r\n\r\nhi", b"\r\n\r\n" + b"a\n" * 900_000)


def attached_long_header() -> bytes:
    """An attached email with a 200 KB Subject, which serialising it back would refold."""
    words = b" ".join([b"=?utf-8?q?hei=C3=9Fe_Sonne?="] * 8000)
    inner = b"From: in@example.org\r\nSubject: " + words + b"\r\n\r\ninner body\r\n"
    return (
        HEAD + b'Content-Type: multipart/mixed; boundary="x"\r\n\r\n--x\r\n'
        b"Content-Type: message/rfc822\r\n\r\n" + inner + b"--x--\r\n"
    )


def large_attachment() -> bytes:
    """Reference: a legitimate 40 MB email, one base64 attachment of 30 MB."""
    payload = base64.encodebytes(os.urandom(30 * 1024 * 1024)).replace(b"\n", b"\r\n")
    return (
        HEAD + b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary="x"\r\n\r\n'
        b"--x\r\nContent-Type: text/plain\r\n\r\nsee attached\r\n--x\r\n"
        b"Content-Type: application/octet-stream\r\n"
        b'Content-Disposition: attachment; filename="data.bin"\r\n'
        b"Content-Transfer-Encoding: base64\r\n\r\n" + payload + b"--x--\r\n"
    )


def corpus_file(name: str) -> Callable[[], bytes | None]:
    def read() -> bytes | None:
        path = CORPUS_EMAILS / name
        return path.read_bytes() if path.exists() else None

    read.__doc__ = f"Reference: the corpus's {name}."
    return read


INPUTS: dict[str, Callable[[], bytes | None]] = {
    "400k empty parts": many_parts,
    "40k Content-Type params": many_params,
    "punycode body 600 KB": punycode_body,
    "8-bit Subject over 4 KB": long_8bit_subject,
    "line without a colon": malformed_line,
    "garbled first line": garbled_first_line,
    "4M short lines": many_lines,
    "400k header fields": many_headers,
    "delivery-status 400k blocks": delivery_status,
    "1000 nested multiparts": lambda: nested_multipart(1000),
    "1000 nested attached emails": lambda: nested_email(1000),
    "25 nested, 900k lines": deep_with_lines,
    "attached email, 200 KB header": attached_long_header,
    "reference: 40 MB attachment": large_attachment,
    "reference: corpus 3 MB, 3043 parts": corpus_file("flanker/enclosed-endless.eml"),
}
