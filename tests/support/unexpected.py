"""A bug in the pipeline, for the structured-log test.

Loaded into a real worker with ``celery -A mailpipe worker -I tests.support.unexpected``, it makes
the steps of every email job raise an error nothing foresaw, after the lease and the attempt
count: the pipeline records it on the run, logs its traceback and retries, as it would for a real
bug.
"""

from __future__ import annotations

from mailpipe.pipeline import job

MESSAGE = "an error nothing foresaw"


def _steps_that_raise(res, email_id: int, *args: object, **kwargs: object) -> job.Verdict:  # type: ignore[no-untyped-def]
    raise RuntimeError(f"{MESSAGE} (email {email_id})")


job._run_steps = _steps_that_raise
