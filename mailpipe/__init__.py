"""mailpipe: a Celery worker fleet that processes stored emails (docs/architecture.md).

Upstream code that stores emails itself enqueues them with `mailpipe.enqueue.enqueue_email`.
Importing the package, or any module of it, changes nothing global.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    # The release, as `mailpipe --version`, every worker's start line and the RunningTasks
    # metric's Version dimension show it (CHANGELOG.md).
    __version__ = version("mailpipe")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
