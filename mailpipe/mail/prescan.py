"""The raw bytes' structure, read cheaply before the email package builds anything.

The standard library's parser costs far more than the bytes it reads when they are hostile: it
builds one object per MIME part and parses the parent's Content-Type again for every child
(400,000 empty parts in 2 MB took 22.9 s and 249 MB), parses every Content-Type with a parser
that is quadratic in its parameters (40,000 of them in 389 KB: 22.4 s, 322 MB), keeps one string
per line (84 bytes each: a 32 MB body of short lines took 1.35 GB) and checks every line against
the boundary of every enclosing multipart. `prescan` walks the same structure with a few regular
expressions over the bytes, in time linear in them and memory that does not grow with them, and
raises `InputRejected` at the first limit broken, so that a hostile email fails in milliseconds.

It also makes header blocks readable. The standard library ends a header block at the first line
that is not a header (no colon, a garbled first line): the good headers after it become body. Such
a line is skipped here, and counted, when a header follows it; and a charset label outside
`ALLOWED_CODECS` in an encoded word (RFC 2047) or a parameter value (RFC 2231) is replaced by
`utf-8`, so that no header is ever decoded with punycode or UTF-7 by the email package. The parser
then reads `Prescan.raw`: the input itself, or a copy with those edits.

The walk follows `email.feedparser`: lines end at CR LF, CR or LF; a boundary line is `--` and
the boundary, optionally `--`, then spaces or tabs; a line that matches the boundary of an
enclosing multipart ends the inner ones (the outermost such multipart takes it); message/* parts
hold another email; a message/delivery-status part holds one header block per blank line. It is
an estimate where the two could disagree (a Content-Type the email package reads differently),
which is why `parse_email` also counts the parts the parser builds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mailpipe.errors import InputRejected
from mailpipe.mail.text import allowed_codec

# Limits fixed in code, each far above what real mail needs (the shared corpus' largest is in
# brackets) and far below what makes the parser slow. Parts and multipart depth are the settings'
# (MAILPIPE_MAX_MIME_PARTS, MAILPIPE_MAX_MIME_DEPTH).
#
# Lines in the whole email: the parser keeps a string of ~84 bytes per line, and checks each one
# against every enclosing boundary (~80 ns each). A 50 MB email of base64 has ~680,000 lines.
MAX_LINES = 1_000_000
# Bytes of one header block, and header fields in it [80 KB / 63 fields; a 200 KB Subject is
# read by the plain decoder, see parse.LONG_HEADER_CHARS].
MAX_HEADER_BLOCK_BYTES = 1 << 20
MAX_HEADER_FIELDS = 1000
# Header lines (fields, continuations, lines skipped) in all the header blocks together: the
# pre-scan reads them one by one (~2.5 µs each) and the parser keeps an object per field. [2,700
# for the 200 KB Subject; a part has a handful.]
MAX_HEADER_LINES = 20_000
# Content-Type, Content-Disposition and Content-Transfer-Encoding are parsed by the email
# package's structured parser, ~20 µs per byte of token-dense input and quadratic past ~16 KB: per
# field [~300 bytes], parameters (";") per field [10], and all of them in the email together.
MIME_HEADERS = frozenset({b"content-type", b"content-disposition", b"content-transfer-encoding"})
MAX_MIME_HEADER_BYTES = 8192
MAX_MIME_HEADER_PARAMS = 100
MAX_MIME_HEADER_BYTES_TOTAL = 512 * 1024
# Entities the parser builds in all, attached emails' included, per part that the settings allow
# in the email itself (MAILPIPE_MAX_MIME_PARTS, which `parse_email` counts as it walks the email,
# and each attached email's conversion counts again in that email). A corpus email with an
# attached email of 3,038 parts builds 3,043 in all. A part costs ~0.6 KB and ~20 µs to build.
PARSED_PARTS_PER_PART = 10
# Entities nested in entities, attached emails included: the parser recurses per level and gives
# up near 200. Attached emails are nested up to MAILPIPE_MAX_MIME_DEPTH deep by the documents
# step; each is two levels (the message/rfc822 part, then the email), plus its multiparts.
MAX_PARSE_DEPTH = 100
# A run of lines that are not headers is skipped only if it is this short and a header follows.
MAX_SKIPPED_RUN = 4
# Skipped lines listed on ParsedEmail (all are counted).
MAX_LISTED_SKIPS = 20

NESTED_TOO_DEEPLY = "MIME structure is nested too deeply to parse"


def too_many_parsed_parts(max_parts: int) -> str:
    return (
        f"email has more than {max_parts * PARSED_PARTS_PER_PART} MIME parts in all, "
        "attached emails' included"
    )


# What email.feedparser takes for a header line (headerRE), on bytes: a field name and a colon
# (the name may be empty), a continuation, or an mbox "From " line.
_HEADERISH = re.compile(rb"From |[\x21-\x39\x3b-\x7e]*:|[\t ]")
_FIELD = re.compile(rb"([\x21-\x39\x3b-\x7e]+):")
_LINE = re.compile(rb"[^\r\n]*(?>\r\n|\r|\n)?")
_BLANK_LINE = re.compile(rb"(?>\r\n|\r|\n)(?=[\r\n])")
_FOLD = re.compile(rb"(?:\r\n|\r|\n)(?=[ \t])")
_NEWLINE_BYTES = frozenset(b"\r\n")
_BLANK_BYTES = frozenset(b" \t")
# An encoded word's charset (RFC 2047, with an optional RFC 2231 language), and the charset of an
# RFC 2231 extended parameter value (name*=charset'lang'..., name*0*=charset'lang'...).
_ENCODED_WORD_CHARSET = re.compile(rb"=\?([^?*\s]+)(?:\*[^?\s]*)?\?[bBqQ]\?")
_EXTENDED_VALUE_CHARSET = re.compile(rb"\*\s*=\s*\"?([^'\";\s]*)'")
_BOUNDARY = re.compile(rb"""(?:^|;)\s*boundary\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;]*))""", re.I)


@dataclass(frozen=True)
class Prescan:
    raw: bytes  # what the parser reads: the input, or a copy with the edits below
    parts: int  # MIME parts of the email itself, counted as `parse_email` walks them
    parsed_parts: int  # MIME entities the parser will build, attached emails' included
    header_names: frozenset[str]  # lowercase names of the top header block's fields
    skipped_lines: int  # header lines skipped, in every header block
    skipped: tuple[str, ...]  # the first MAX_LISTED_SKIPS of them, for the record
    relabelled: int  # charset labels replaced by utf-8


def prescan(raw: bytes, *, max_parts: int, max_depth: int) -> Prescan:
    """Walk `raw`'s MIME structure; raise `InputRejected` at the first limit it breaks.

    `max_parts` and `max_depth` bound the parts of the email itself and their multipart nesting,
    as `parse_email` counts them (an attached email is one part; its own parts are bounded when it
    is converted). All the entities the parser will build, attached emails' included, are bounded
    by `max_parts * PARSED_PARTS_PER_PART`, their nesting by MAX_PARSE_DEPTH.
    """
    lines = raw.count(b"\n") + raw.count(b"\r") - raw.count(b"\r\n")
    if lines > MAX_LINES:
        raise InputRejected(f"email has {lines} lines, over the limit of {MAX_LINES}")
    walk = _Walk(raw, max_parts, max_depth)
    walk.entity(0, level=0, walked_depth=0, root=True, default_type=b"text/plain")
    return Prescan(
        raw=walk.edited(),
        parts=walk.parts,
        parsed_parts=walk.parsed_parts,
        header_names=frozenset(walk.top_names),
        skipped_lines=walk.skipped_lines,
        skipped=tuple(walk.skipped),
        relabelled=walk.relabelled,
    )


def top_header_names(raw: bytes) -> frozenset[str]:
    """Lowercase names of the fields of `raw`'s first header block, read as `prescan` reads it
    (a malformed line followed by a header is skipped). Never raises; bounded work."""
    walk = _Walk(raw, max_parts=1, max_depth=0)
    try:
        walk.headers(0, root=True)
    except InputRejected:
        pass
    return frozenset(walk.top_names)


@dataclass
class _Head:
    body: int  # where the body starts
    content_type: bytes | None = None  # the first Content-Type, unfolded


@dataclass
class _Walk:
    raw: bytes
    max_parts: int
    max_depth: int
    parts: int = 0
    parsed_parts: int = 0
    mime_bytes: int = 0
    skipped_lines: int = 0
    relabelled: int = 0
    skipped: list[str] = field(default_factory=list)
    top_names: set[str] = field(default_factory=set)
    # (start, end, replacement), in order of position, never overlapping.
    edits: list[tuple[int, int, bytes]] = field(default_factory=list)
    # The boundaries of the open multiparts, outermost first.
    open: list[bytes] = field(default_factory=list)
    header_lines: int = 0
    _patterns: dict[tuple[bytes, ...], tuple[re.Pattern[bytes], ...]] = field(default_factory=dict)

    # --- entities -------------------------------------------------------------------------

    def entity(
        self, pos: int, *, level: int, walked_depth: int | None, root: bool, default_type: bytes
    ) -> int:
        """Walk the entity starting at `pos`; return where it ends (the start of the boundary line
        that ends it, or the end of the input). `walked_depth` is its multipart depth in the email
        that `parse_email` walks, None inside an attached email."""
        self._count_part(walked=walked_depth is not None)
        if level > MAX_PARSE_DEPTH:
            raise InputRejected(NESTED_TOO_DEEPLY)
        if walked_depth is not None and walked_depth > self.max_depth:
            raise InputRejected(f"MIME parts nested deeper than {self.max_depth} levels")
        head = self.headers(pos, root=root)
        content_type, boundary = _content_type(head.content_type, default_type)
        if content_type == b"message/delivery-status":
            end = self._next_boundary(head.body)[0]
            self._status_blocks(head.body, end)
            return end
        if content_type.startswith(b"message/"):
            return self.entity(
                head.body, level=level + 1, walked_depth=None, root=True, default_type=b"text/plain"
            )
        if content_type.startswith(b"multipart/") and boundary is not None:
            child_type = b"message/rfc822" if content_type == b"multipart/digest" else b"text/plain"
            return self._multipart(head.body, boundary, level, walked_depth, child_type)
        return self._next_boundary(head.body)[0]

    def _multipart(
        self, pos: int, boundary: bytes, level: int, walked_depth: int | None, child_type: bytes
    ) -> int:
        self.open.append(boundary)
        mine = len(self.open) - 1
        try:
            while True:
                start, end, owner, close = self._next_boundary(pos)
                if owner is None or owner < mine:
                    return start  # the end of the input, or an enclosing multipart's line
                if close:
                    break
                # Like the parser, take repeated boundary lines as one.
                while (again := self._boundary_at(end)) is not None and again[2] == mine:
                    end = again[1]
                pos = self.entity(
                    end,
                    level=level + 1,
                    walked_depth=None if walked_depth is None else walked_depth + 1,
                    root=False,
                    default_type=child_type,
                )
        finally:
            self.open.pop()
        # After the closing line: the epilogue, up to an enclosing multipart's next line.
        return self._next_boundary(end)[0]

    def _status_blocks(self, pos: int, end: int) -> None:
        """A message/delivery-status body: the parser builds one entity, and one more after each
        blank line that is not the body's last line."""
        self._count_part(walked=False)
        for found in _BLANK_LINE.finditer(self.raw, pos, end):
            blank_end = found.end() + (2 if self.raw.startswith(b"\r\n", found.end()) else 1)
            if blank_end < end:
                self._count_part(walked=False)

    def _count_part(self, *, walked: bool) -> None:
        self.parsed_parts += 1
        if walked:
            self.parts += 1
            if self.parts > self.max_parts:
                raise InputRejected(f"email has more than {self.max_parts} MIME parts")
        if self.parsed_parts > self.max_parts * PARSED_PARTS_PER_PART:
            raise InputRejected(too_many_parsed_parts(self.max_parts))

    # --- boundaries -----------------------------------------------------------------------

    def _next_boundary(self, pos: int) -> tuple[int, int, int | None, bool]:
        """The next line from `pos` that matches an open boundary: (start, end of the line, index
        in `open` of the multipart it belongs to, whether it closes), or the end of the input.
        `pos` is the start of a line."""
        if self.open:
            if (here := self._boundary_at(pos)) is not None:
                return here
            # After a line ending. A literal prefix lets the regex engine skip ahead (60 times
            # faster than a class of CR and LF over a body of dashes); a line ending in a bare CR
            # is looked for only up to the next LF one.
            _, after_lf, after_cr = self._patterns_for_open()
            found = after_lf.search(self.raw, pos)
            before = found.start() if found is not None else len(self.raw)
            found = after_cr.search(self.raw, pos, before) or found
            if found is not None:
                return found.start() + 1, found.end(), self.open.index(found[1]), bool(found[2])
        return len(self.raw), len(self.raw), None, False

    def _boundary_at(self, pos: int) -> tuple[int, int, int, bool] | None:
        """The boundary line starting at `pos`, if there is one."""
        if not self.open:
            return None
        found = self._patterns_for_open()[0].match(self.raw, pos)
        if found is None:
            return None
        return pos, found.end(), self.open.index(found[1]), bool(found[2])

    def _patterns_for_open(self) -> tuple[re.Pattern[bytes], ...]:
        """A boundary line of the open multiparts: at a position, after an LF, after a CR."""
        key = tuple(self.open)
        patterns = self._patterns.get(key)
        if patterns is None:
            choices = b"|".join(re.escape(b) for b in sorted(set(key), key=len, reverse=True))
            line = rb"--(" + choices + rb")(--)?[ \t]*(?:\r\n|\r|\n|\Z)"
            patterns = tuple(re.compile(prefix + line) for prefix in (b"", b"\n", b"\r"))
            self._patterns[key] = patterns
        return patterns

    # --- header blocks --------------------------------------------------------------------

    def headers(self, pos: int, *, root: bool) -> _Head:
        """Read the header block at `pos`, check its limits, plan its edits; return where its body
        starts. `root`: the block of an email (the whole input, or an attached email), where a
        garbled first line is skipped too; in a part's block only lines after a header are."""
        raw = self.raw
        start = pos
        fields = 0
        head = _Head(body=len(raw))
        field_start = -1  # the current field's first byte; -1 when there is none
        field_name = b""
        while True:
            line = _LINE.match(raw, pos)
            assert line is not None  # the pattern matches the empty string
            end = line.end()
            if end == pos or self._boundary_at(pos) is not None:
                head.body = pos  # the end of the input, or of the part
                break
            if raw[pos] in _NEWLINE_BYTES:
                head.body = end  # the blank line that ends the block
                break
            self.header_lines += 1
            if self.header_lines > MAX_HEADER_LINES:
                raise InputRejected(f"header blocks have over {MAX_HEADER_LINES} lines in all")
            window = min(end, pos + 4096)  # a field name is read from a line's start only
            if _HEADERISH.match(raw, pos, window) is None:
                skip_to = self._skippable_run(pos, allowed=root or fields > 0)
                if skip_to is None:
                    head.body = pos  # like the parser: the body starts at this line
                    break
                if field_start >= 0:
                    self._field(field_name, field_start, pos, head)
                    field_start = -1
                self._skip(pos, skip_to)
                pos = skip_to
                continue
            if end - start > MAX_HEADER_BLOCK_BYTES:
                raise InputRejected(f"a header block is over {MAX_HEADER_BLOCK_BYTES} bytes")
            if raw[pos] not in _BLANK_BYTES:  # not a continuation: a new field starts
                if field_start >= 0:
                    self._field(field_name, field_start, pos, head)
                named = _FIELD.match(raw, pos, window)
                field_start, field_name = (pos, named[1].lower()) if named else (-1, b"")
                if named:
                    fields += 1
                    if fields > MAX_HEADER_FIELDS:
                        raise InputRejected(f"a header block has over {MAX_HEADER_FIELDS} fields")
                    if start == 0:
                        self.top_names.add(field_name.decode("ascii"))
            pos = end
        if field_start >= 0:
            self._field(field_name, field_start, pos, head)
        return head

    def _skippable_run(self, pos: int, *, allowed: bool) -> int | None:
        """Where the run of lines at `pos` that are not headers ends, if it is at most
        MAX_SKIPPED_RUN lines (their continuations included) and a header field follows it."""
        if not allowed:
            return None
        raw = self.raw
        for _ in range(MAX_SKIPPED_RUN):
            line = _LINE.match(raw, pos)
            assert line is not None
            if line.end() == pos:
                return None
            pos = line.end()
            following = raw[pos : pos + 4096]
            if not following or following[:1] in (b"\r", b"\n"):
                return None  # the end, or a blank line: the run was the body's start
            if self._boundary_at(pos) is not None:
                return None
            if _FIELD.match(following):
                return pos
            if following[:1] not in (b" ", b"\t") and _HEADERISH.match(following):
                return None  # a line the parser reads as a header, but no field: not skipped
        return None

    def _skip(self, start: int, end: int) -> None:
        lines = [line for line in _LINE.findall(self.raw, start, end) if line]
        self.skipped_lines += len(lines)
        for line in lines[: max(0, MAX_LISTED_SKIPS - len(self.skipped))]:
            self.skipped.append(line.rstrip(b"\r\n")[:80].decode("utf-8", "replace"))
        self.edits.append((start, end, b""))

    def _field(self, name: bytes, start: int, end: int, head: _Head) -> None:
        """Check one header field (raw[start:end]: its name and folded value); plan its edits."""
        raw = self.raw
        mime = name in MIME_HEADERS
        if mime:
            size = end - start - len(name) - 1
            if size > MAX_MIME_HEADER_BYTES:
                raise InputRejected(
                    f"a {name.decode()} header is {size} bytes, over {MAX_MIME_HEADER_BYTES}"
                )
            params = raw.count(b";", start, end)
            if params > MAX_MIME_HEADER_PARAMS:
                raise InputRejected(
                    f"a {name.decode()} header has {params} parameters, "
                    f"over {MAX_MIME_HEADER_PARAMS}"
                )
            self.mime_bytes += size
            if self.mime_bytes > MAX_MIME_HEADER_BYTES_TOTAL:
                raise InputRejected(
                    "the MIME headers (Content-Type, -Disposition, -Transfer-Encoding) total "
                    f"over {MAX_MIME_HEADER_BYTES_TOTAL} bytes"
                )
            if name == b"content-type" and head.content_type is None:
                value = raw[start + len(name) + 1 : end]
                head.content_type = _FOLD.sub(b"", value).strip()
        patterns = (
            (_ENCODED_WORD_CHARSET, _EXTENDED_VALUE_CHARSET) if mime else (_ENCODED_WORD_CHARSET,)
        )
        labels = sorted(
            (found.span(1) for pattern in patterns for found in pattern.finditer(raw, start, end)),
        )
        last_end = start
        for label_start, label_end in labels:
            label = raw[label_start:label_end].decode("latin-1")
            if label_start < last_end or allowed_codec(label) is not None:
                continue
            if label.lower() == "utf-8":
                continue
            self.edits.append((label_start, label_end, b"utf-8"))
            self.relabelled += 1
            last_end = label_end

    def edited(self) -> bytes:
        if not self.edits:
            return self.raw
        pieces = []
        pos = 0
        for start, end, replacement in sorted(self.edits):
            pieces += [self.raw[pos:start], replacement]
            pos = end
        pieces.append(self.raw[pos:])
        return b"".join(pieces)


def _content_type(value: bytes | None, default: bytes) -> tuple[bytes, bytes | None]:
    """(lowercase type, boundary or None) as the email package reads them, near enough."""
    if value is None:
        return default, None
    kind = value.split(b";", 1)[0].strip().lower()
    if kind.count(b"/") != 1 or any(c in kind for c in b" \t()"):
        return b"text/plain", None
    boundary = None
    found = _BOUNDARY.search(value)
    if found is not None:
        if found[1] is not None:
            boundary = found[1].replace(b"\\\\", b"\\").replace(b'\\"', b'"').rstrip()
        else:
            boundary = found[2].strip()
    return kind, boundary
