"""mailpipe: a Celery worker fleet that processes stored emails.

Upstream code that stores emails itself enqueues them with `mailpipe.enqueue.enqueue_email`.
"""
