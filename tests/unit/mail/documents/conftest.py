"""Fixtures for the document conversion tests.

`convert` runs `convert_attachment` under a Python audit hook and fails the test if the
conversion wrote, renamed or deleted a file, opened a network connection or started a process.
That is the test of "nothing is written to disk, nothing is fetched" for every input at once,
not only for the ones built to try. (Network access from C code, such as libxml2 loading an
external DTD, does not pass through the hook; `http_server` catches that.)
"""

from __future__ import annotations

import http.server
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from mailpipe.mail.documents import ConvertedDocument, DocumentLimits, convert_attachment
from mailpipe.mail.parse import Attachment
from tests.support.document_samples import DEFAULT_LIMITS

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_FORBIDDEN_EVENTS = {
    "os.mkdir",
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.truncate",
    "shutil.copyfile",
    "shutil.move",
    "socket.connect",
    "socket.getaddrinfo",
    "socket.sendto",
    "urllib.Request",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.fork",
}


@dataclass
class _SideEffects:
    recording: bool = False
    seen: list[tuple[str, tuple[object, ...]]] = field(default_factory=list)

    def hook(self, event: str, args: tuple[object, ...]) -> None:
        if not self.recording:
            return
        if event in _FORBIDDEN_EVENTS or (event == "open" and _opens_for_writing(args)):
            self.seen.append((event, args))


def _opens_for_writing(args: tuple[object, ...]) -> bool:
    path, mode, flags = args
    if "__pycache__" in str(path):
        return False  # the interpreter caching bytecode for a module imported lazily
    if isinstance(mode, str):
        return any(letter in mode for letter in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


# Audit hooks cannot be removed; this one does nothing unless a conversion is being recorded.
_SIDE_EFFECTS = _SideEffects()
sys.addaudithook(_SIDE_EFFECTS.hook)


@pytest.fixture(scope="session")
def limits() -> DocumentLimits:
    return DEFAULT_LIMITS


def _convert(att: Attachment, limits: DocumentLimits) -> ConvertedDocument:
    _SIDE_EFFECTS.seen.clear()
    _SIDE_EFFECTS.recording = True
    try:
        document = convert_attachment(att, limits)
    finally:
        _SIDE_EFFECTS.recording = False
    assert _SIDE_EFFECTS.seen == [], "conversion touched files, network or processes"
    return document


@pytest.fixture(scope="session")
def convert() -> Callable[[Attachment, DocumentLimits], ConvertedDocument]:
    """Session-wide, so that a module's fixture can share one conversion among its tests."""
    return _convert


class _RequestLog(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'<!ENTITY lol "fetched">')

    def log_message(self, format: str, *args: object) -> None:
        """Silenced: the paths requested are the record."""


@pytest.fixture
def http_server() -> Iterator[tuple[str, list[str]]]:
    """A server on loopback that records every path requested: its base URL and that list."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RequestLog)
    server.paths = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server.paths  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
