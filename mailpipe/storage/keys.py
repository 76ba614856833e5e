"""Blob keys: built by mailpipe from ids and hashes, and checked against `KEY_PATTERN`; no name
found in an email ever becomes a key or a path. Shared by every blob store."""

from __future__ import annotations

import re

KEY_PATTERN = re.compile(r"^[a-z0-9][a-z0-9/_.-]{0,254}$")


# The prefixes the pipeline reads and writes under: raw emails, and document texts too long to
# keep in their row. The blob store's health check writes under each.
RAW_PREFIX = "raw"
TEXT_PREFIX = "text"


def raw_email_key(sha256: str) -> str:
    """Content-addressed: storing the same raw bytes twice writes one object."""
    return f"{RAW_PREFIX}/{sha256[:2]}/{sha256}.eml"


def document_text_key(email_id: int, part_index: int) -> str:
    return f"{document_texts(email_id)}{part_index}.txt"


def document_texts(email_id: int) -> str:
    """The folder of the email's document texts."""
    return f"{TEXT_PREFIX}/{email_id}/"


def check_key(key: str) -> str:
    if not KEY_PATTERN.match(key) or ".." in key:
        raise ValueError(f"invalid blob key {key!r}")
    return key


def check_folder(prefix: str) -> str:
    """A key prefix that names a folder: a key that ends with /."""
    if not prefix.endswith("/"):
        raise ValueError(f"blob prefix {prefix!r} is no folder: it ends with /")
    return check_key(prefix)
