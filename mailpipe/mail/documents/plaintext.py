"""text/* and CSV attachments: decoded with the same charset fallbacks as email bodies.

CSV stays as it is: its commas and quotes read well enough for a classifier, and parsing it would
only add ways to fail (a wrong delimiter guess, a runaway quoted field).
"""

from __future__ import annotations

from mailpipe.mail.documents.result import Extracted
from mailpipe.mail.text import decode_text


def convert_text(payload: bytes, charset: str | None) -> Extracted:
    return Extracted(decode_text(payload, charset))
