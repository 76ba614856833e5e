"""HTML attachments: the visible text, through the same `html_to_text` as HTML email bodies.

Nothing is fetched: BeautifulSoup's html.parser only reads the markup it is given, so remote
images, stylesheets and scripts stay inert attributes, and script and style content is dropped.
`html_to_text` reads a bounded prefix of the markup (`mailpipe.mail.text.MAX_MARKUP_CHARS`).
"""

from __future__ import annotations

from mailpipe.mail.documents.result import Extracted
from mailpipe.mail.text import decode_text, html_to_text


def convert_html(payload: bytes, charset: str | None) -> Extracted:
    return Extracted(html_to_text(decode_text(payload, charset)))
