"""The fleet's switches as a test's set-up turns them: straight in the database, with no audit
line and no sweep (the operator's switch is `actions.switch_model_calls`)."""

from __future__ import annotations

from mailpipe.resources import Resources
from mailpipe.storage import flags


def set_model_calls(res: Resources, on: bool) -> None:
    with res.db.transaction() as session:
        flags.set_model_calls(session, on)
