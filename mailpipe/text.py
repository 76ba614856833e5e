"""Bytes and markup to plain text, for email bodies and text attachments alike."""

from __future__ import annotations

import codecs
import re

from bs4 import BeautifulSoup
from charset_normalizer import from_bytes

# Tags whose content is never readable text. Nothing in a document is ever fetched: BeautifulSoup
# only parses the markup it is given, and links and images stay inert attributes.
_INVISIBLE_TAGS = ("script", "style", "head", "title", "noscript", "template", "iframe", "object")
_BLANK_LINES = re.compile(r"\n\s*\n+")
# BeautifulSoup's tree costs about 100 bytes of memory per byte of tag-dense markup (measured:
# 108 MiB for 1 MB of <p> tags; 2.2 GB and 49 s for 20 MB), so only this much markup is read.
# Its text, at most as long, is well over what the classifier reads.
MAX_MARKUP_CHARS = 1_000_000


def decode_text(data: bytes, declared_charset: str | None = None) -> str:
    """Decode text whose declared charset may be missing, wrong or unknown to Python.

    Order: the declared charset when Python knows it and it decodes cleanly; then charset
    detection; then UTF-8 with replacement characters, which never fails.
    """
    if declared_charset:
        try:
            codec = codecs.lookup(declared_charset.strip().strip("\"'"))
            return data.decode(codec.name)
        except (LookupError, UnicodeDecodeError, ValueError):
            pass
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    best = from_bytes(data).best()
    if best is not None:
        return str(best)
    return data.decode("utf-8", errors="replace")


def html_to_text(markup: str) -> str:
    """Readable text of an HTML document (its first `MAX_MARKUP_CHARS`): visible text only, one
    block per line."""
    soup = BeautifulSoup(markup[:MAX_MARKUP_CHARS], "html.parser")
    for tag in soup(_INVISIBLE_TAGS):
        tag.decompose()
    text = soup.get_text("\n", strip=True)
    return _BLANK_LINES.sub("\n\n", text)
