"""Attachments to text, safely: step 6 of the job.

`convert_attachment` turns one `Attachment` into one `ConvertedDocument` and never raises for bad
input. Nothing is fetched, nothing is written to disk, and every document is bounded in bytes,
zip size and ratio, pages, nesting, text and time (see `DocumentLimits`).
"""

from mailpipe.mail.documents.convert import convert_attachment, document_for
from mailpipe.mail.documents.filenames import safe_filename
from mailpipe.mail.documents.limits import DocumentLimits
from mailpipe.mail.documents.result import ConvertedDocument

__all__ = [
    "ConvertedDocument",
    "DocumentLimits",
    "convert_attachment",
    "document_for",
    "safe_filename",
]
