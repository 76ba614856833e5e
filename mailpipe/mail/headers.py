"""The plain header values that the email package would give back as they came, read without it.

The default policy parses a header into a token tree each time it builds one: 20 to 65 µs per
header of a small email, most of what reading its five headers costs. Most headers need none of
that: a Subject of printable ASCII, an address list of plain `name <user@host>` mailboxes, a
Message-ID of one `<id@host>`. `plain_value` recognises those with a regular expression and gives
the text the default policy's header object would (unfolded, and rendered as it renders it);
anything else (an encoded word, a quoted or commented name, a group, 8-bit bytes) returns None,
for the default policy to read. tests/unit/mail/test_headers.py checks the two agree.
"""

from __future__ import annotations

import email.utils
import re

# RFC 5322 atext, and dot-atoms of it: what a name word, a user and a host may hold unquoted.
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_DOT_ATOM = rf"{_ATOM}(?:\.{_ATOM})*"
_ADDRESS = rf"{_DOT_ATOM}@{_DOT_ATOM}"
# A mailbox as the policy renders it: the bare address, or words and the address in brackets.
_MAILBOX = re.compile(
    rf"(?P<address>{_ADDRESS})|(?P<name>{_ATOM}(?:[ \t]+{_ATOM})*)[ \t]*<(?P<bracketed>{_ADDRESS})>"
)
_MESSAGE_ID = re.compile(rf"<{_DOT_ATOM}@{_DOT_ATOM}>")
# Printable ASCII and tabs: what an unstructured header holds when it needs no decoding.
_PRINTABLE = re.compile(r"[\t -~]*")
_FOLDS = re.compile(r"[\r\n]")

_ADDRESS_HEADERS = frozenset({"from", "to", "cc"})  # the ones a parsed email keeps
_UNSTRUCTURED_HEADERS = frozenset({"subject"})


def plain_value(name: str, raw: str) -> str | None:
    """What `str(email.policy.default.header_factory(name, unfolded raw))` gives, for the headers
    and values this module knows to be plain; None for every other."""
    value = _FOLDS.sub("", raw)
    if "=?" in value or not _PRINTABLE.fullmatch(value):
        return None
    kind = name.lower()
    if kind in _UNSTRUCTURED_HEADERS:
        return value
    if kind in _ADDRESS_HEADERS:
        return _mailboxes(value)
    if kind == "message-id":
        return value if _MESSAGE_ID.fullmatch(value) else None
    if kind == "date":
        return _date(value)
    return None


def normalise_message_id(value: str) -> str | None:
    """A Message-ID as origins store it and the search looks it up: no angle brackets or white
    space, lowercase; None for an empty one."""
    value = "".join(value.split()).strip("<>").lower()
    return value or None


def _mailboxes(value: str) -> str | None:
    rendered = []
    for item in value.split(","):
        mailbox = _MAILBOX.fullmatch(item.strip(" \t"))
        if mailbox is None:
            return None
        if mailbox["address"] is not None:
            rendered.append(mailbox["address"])
        else:
            rendered.append(f"{' '.join(mailbox['name'].split())} <{mailbox['bracketed']}>")
    return ", ".join(rendered)


def _date(value: str) -> str | None:
    # The policy's DateHeader renders the parsed date again; one it cannot parse it keeps as it
    # came, with a defect, which is left to it.
    try:
        return email.utils.format_datetime(email.utils.parsedate_to_datetime(value))
    except (TypeError, ValueError, OverflowError):
        return None
