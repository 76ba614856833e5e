"""Bytes and markup to plain text, for email bodies and text attachments alike."""

from __future__ import annotations

import encodings
import re
from encodings.aliases import aliases as _codec_aliases

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


# The codecs that text is ever decoded with: the Unicode encodings and the single- and multi-byte
# charsets of real mail, all decoded in C in time linear in the input. Left out on purpose:
# punycode and idna (pure Python; punycode's decoder is quadratic: 600 KB took 10 s), utf-7 (can
# spell "<" and lone surrogates in ASCII, and is stateful), the unicode-escape codecs (turn
# backslashes into any character, lone surrogates included), and the bytes-to-bytes codecs
# (base64, zlib, bz2, uu, hex, quopri, rot-13). A declared charset outside this list is treated
# as unknown: UTF-8, then detection, then UTF-8 with replacement characters.
ALLOWED_CODECS = frozenset(
    {
        # Unicode
        "ascii", "latin_1", "utf_8", "utf_8_sig", "utf_16", "utf_16_be", "utf_16_le",
        "utf_32", "utf_32_be", "utf_32_le",
        # single-byte: ISO 8859, Windows, DOS, Mac, KOI8, EBCDIC and the rest
        "iso8859_2", "iso8859_3", "iso8859_4", "iso8859_5", "iso8859_6", "iso8859_7",
        "iso8859_8", "iso8859_9", "iso8859_10", "iso8859_11", "iso8859_13", "iso8859_14",
        "iso8859_15", "iso8859_16",
        "cp1250", "cp1251", "cp1252", "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258",
        "cp437", "cp720", "cp737", "cp775", "cp850", "cp852", "cp855", "cp856", "cp857", "cp858",
        "cp860", "cp861", "cp862", "cp863", "cp864", "cp865", "cp866", "cp869", "cp874",
        "cp1006", "cp1125", "cp037", "cp273", "cp424", "cp500", "cp875", "cp1026", "cp1140",
        "mac_arabic", "mac_croatian", "mac_cyrillic", "mac_farsi", "mac_greek", "mac_iceland",
        "mac_latin2", "mac_roman", "mac_romanian", "mac_turkish",
        "koi8_r", "koi8_t", "koi8_u", "kz1048", "ptcp154", "tis_620", "hp_roman8", "palmos",
        # multi-byte: Chinese, Japanese, Korean
        "big5", "big5hkscs", "cp950", "gb2312", "gbk", "gb18030", "hz",
        "cp932", "euc_jp", "euc_jis_2004", "euc_jisx0213", "shift_jis", "shift_jis_2004",
        "shift_jisx0213", "iso2022_jp", "iso2022_jp_1", "iso2022_jp_2", "iso2022_jp_2004",
        "iso2022_jp_3", "iso2022_jp_ext",
        "cp949", "euc_kr", "iso2022_kr", "johab",
    }
)  # fmt: skip


def allowed_codec(label: str | None) -> str | None:
    """The codec that the charset `label` names, if it is in ALLOWED_CODECS; else None.

    Resolved as `codecs.lookup` resolves it (lower case, `encodings.normalize_encoding`, then the
    aliases), without importing anything: a label never loads a codec that is not allowed, and an
    unknown label costs a dictionary lookup, not an import attempt.
    """
    if not label:
        return None
    name = encodings.normalize_encoding(label.strip().strip("\"'").lower())
    name = _codec_aliases.get(name) or _codec_aliases.get(name.replace(".", "_")) or name
    return name if name in ALLOWED_CODECS else None


def decode_text(data: bytes, declared_charset: str | None = None) -> str:
    """Decode text whose declared charset may be missing, wrong, unknown or not allowed.

    Order: the declared charset when it is in ALLOWED_CODECS and decodes cleanly; then UTF-8;
    then charset detection, if it names an allowed codec; then UTF-8 with replacement
    characters, which never fails. The result holds no lone surrogate.
    """
    codec = allowed_codec(declared_charset)
    if codec is not None:
        try:
            return data.decode(codec)
        except (UnicodeDecodeError, ValueError):
            pass
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    best = from_bytes(data).best()
    if best is not None and (detected := allowed_codec(best.encoding)) is not None:
        try:
            return data.decode(detected)
        except (UnicodeDecodeError, ValueError):
            pass
    return data.decode("utf-8", errors="replace")


# A run of the characters that `surrogateescape` makes of undecodable bytes; any other surrogate.
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]+")
_NOT_STORABLE = re.compile("[\ud800-\udfff\x00]")


def storable(text: str) -> str:
    """`text` as a database text column takes it: NUL characters removed and no lone surrogate.

    Bytes that a parser kept as surrogates (`surrogateescape`, as the email package does with 8-bit
    header bytes) are read as UTF-8, with a replacement character for what is not UTF-8: what the
    email package's own header parser does with them. Any other surrogate becomes U+FFFD.
    """
    if _NOT_STORABLE.search(text) is None:
        return text
    text = _ESCAPED_BYTES.sub(_escaped_as_utf8, text.replace("\x00", ""))
    return _NOT_STORABLE.sub("\ufffd", text)


def _escaped_as_utf8(run: re.Match[str]) -> str:
    return bytes(ord(c) - 0xDC00 for c in run.group()).decode("utf-8", errors="replace")


def html_to_text(markup: str) -> str:
    """Readable text of an HTML document (its first `MAX_MARKUP_CHARS`): visible text only, one
    block per line."""
    soup = BeautifulSoup(markup[:MAX_MARKUP_CHARS], "html.parser")
    for tag in soup(_INVISIBLE_TAGS):
        tag.decompose()
    text = soup.get_text("\n", strip=True)
    return _BLANK_LINES.sub("\n\n", text)
