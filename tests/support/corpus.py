"""The shared corpus's emails (real mail, and a few files that are not mail), parsed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mailpipe.mail.parse import ParsedEmail, ParseLimits, parse_email
from tests.support.paths import CORPUS

CORPUS_EMAILS = CORPUS / "emails"
CORPUS_LIMITS = ParseLimits(
    max_bytes=50 << 20, max_depth=25, max_parts=1000, body_max_chars=200_000
)


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    raw: bytes
    parsed: ParsedEmail | Exception  # what parse_email returned or raised, under CORPUS_LIMITS


def parse_corpus() -> list[CorpusFile]:
    """Every file under the corpus's emails, in path order."""
    paths = sorted(p for p in CORPUS_EMAILS.rglob("*") if p.is_file())
    assert paths, f"no files under {CORPUS_EMAILS}"
    return [CorpusFile(path, raw, _parse(raw)) for path in paths for raw in [path.read_bytes()]]


def _parse(raw: bytes) -> ParsedEmail | Exception:
    try:
        return parse_email(raw, CORPUS_LIMITS)
    except Exception as exc:  # the tests say which files must parse and which must be rejected
        return exc
