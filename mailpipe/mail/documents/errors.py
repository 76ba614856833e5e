"""Why a document was not converted, raised by the format modules and mapped to a status.

None of these leaves `convert_attachment`: each becomes the status and the short reason recorded
on the document. Their messages are written for an operator reading the `document` row.
"""

from __future__ import annotations

from mailpipe.errors import MailpipeError


class DocumentError(MailpipeError):
    """Base of the reasons a document is not converted."""


class TooLarge(DocumentError):
    """The document breaks a limit; recorded as `too_large`."""


class NestingTooDeep(TooLarge):
    """Attached emails nest deeper than the limit.

    Raised at the innermost level but recorded on the outermost document: the nesting is a
    property of the whole attachment, not of the one part where the count ran out.
    """


class Unreadable(DocumentError):
    """The document is of a supported type but cannot be read (encrypted, forbidden XML, ...);
    recorded as `failed`."""


class Unsupported(DocumentError):
    """No converter reads this format; recorded as `unsupported` with its type and size."""
