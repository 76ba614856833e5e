"""Display names for attachments whose filenames come from strangers.

The result is only ever shown (in `mailpipe show`, in the classifier's prompt); nothing is written
to disk. It is still made safe to use as a path, so that a later careless use cannot turn
`../../etc/passwd` into a write outside a folder, and readable, so that an operator recognises the
attachment.
"""

from __future__ import annotations

import re
import unicodedata

MAX_FILENAME_CHARS = 120
_MAX_SUFFIX_CHARS = 16  # a longer "extension" is just part of the name
_RESERVED = re.compile(r'[<>:"|?*]')  # meaningful to some file system or shell
_SPACES = re.compile(r"\s+")


def printable(text: str) -> str:
    """`text` with white space collapsed and control and format characters removed.

    Format characters (Unicode category Cf) include the right-to-left override that makes
    `invoice\\u202egpj.exe` display as `invoiceexe.jpg`; removing them shows the real name.
    """
    kept = (
        " " if char.isspace() else char
        for char in unicodedata.normalize("NFC", text)
        if char.isspace() or not unicodedata.category(char).startswith("C")
    )
    return _SPACES.sub(" ", "".join(kept)).strip()


def safe_filename(name: str | None, index: int) -> str:
    """A readable name without directories, control characters, `..` or reserved characters.

    The last path segment is kept (`../../etc/passwd` becomes `passwd`), because that is the name
    a sender's mail client showed. Names that end up empty become `attachment-<index>`.
    """
    fallback = f"attachment-{index}"
    if not name:
        return fallback
    segments = [s for s in printable(name).replace("\\", "/").split("/") if s.strip(". ")]
    if not segments:
        return fallback
    cleaned = _RESERVED.sub("_", segments[-1]).strip(". ")
    return _shorten(cleaned) or fallback


def _shorten(name: str) -> str:
    """Cut a long name to the limit, keeping its extension, which says what the file is."""
    if len(name) <= MAX_FILENAME_CHARS:
        return name
    stem, dot, suffix = name.rpartition(".")
    if dot and stem and len(suffix) <= _MAX_SUFFIX_CHARS:
        return f"{stem[: MAX_FILENAME_CHARS - len(suffix) - 1].rstrip('. ')}.{suffix}"
    return name[:MAX_FILENAME_CHARS].rstrip(". ")
