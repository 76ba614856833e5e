"""mailpipe: a Celery worker fleet that processes stored emails (docs/architecture.md).

Upstream code that stores emails itself enqueues them with `mailpipe.enqueue.enqueue_email`.
Importing the package, or any module of it, changes nothing global.
"""
