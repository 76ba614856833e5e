"""Mailboxes: which mailbox an email belongs to, and which of its stage's queues its jobs take.

An email's mailbox is on its row (`email_message.mailbox`): a customer, a user, a shared inbox,
named by upstream storage or `mailpipe ingest --mailbox`. Emails without one belong to the default
mailbox. Names are identifiers chosen upstream and may be addresses, so nothing logs them.

Each lane of each stage is a family of queues: its own and MAILPIPE_MAILBOX_QUEUES shard queues.
The lane's own queue is the default mailbox's, and carries the jobs whose mailbox the sender did
not know and the previous release's, which consumes no shard: so every job of an email without a
mailbox stays where that release takes it, and a rollback strands none. Any other mailbox
hashes to two of the shards, and each of its jobs goes to the shorter of the two: a flood fills
its own two, and another mailbox shares both of them with it only once in C(n, 2) mailboxes
(120 at 16 shards). Workers take a lane's queues in turn (`mailpipe.broker.lanes`), so a
mailbox's job waits behind about one job of each other busy queue, not behind their backlogs
(docs/mailboxes.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from mailpipe.broker.queues import shard_queue

# What the default mailbox is called where a name must be shown or typed (`--mailbox default`
# selects it); its rows hold NULL.
DEFAULT = "default"
MAX_NAME_CHARS = 200


def checked(name: str) -> str:
    """A mailbox's name as given, or ValueError saying what is wrong with it (never the name)."""
    if not name.strip():
        raise ValueError("a mailbox's name is empty")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a mailbox's name is over {MAX_NAME_CHARS} characters")
    if not name.isprintable():
        raise ValueError("a mailbox's name holds a control character")
    return name


def stored(name: str | None) -> str | None:
    """The column's value for a mailbox given by name: NULL for the default one."""
    return None if name is None or name == DEFAULT else checked(name)


def shown(mailbox: str | None) -> str:
    """The name of a row's mailbox as shown and typed."""
    return DEFAULT if mailbox is None else mailbox


def shards_of(mailbox: str | None, shards: int) -> tuple[int, int]:
    """The two shards (0 .. shards - 1, distinct when there are two or more) a mailbox's jobs
    may take: a stable hash of its name, the same in every process and release."""
    digest = hashlib.blake2b((mailbox or "").encode(), digest_size=8).digest()
    first = int.from_bytes(digest[:4], "big") % shards
    if shards < 2:
        return first, first
    second = (first + 1 + int.from_bytes(digest[4:], "big") % (shards - 1)) % shards
    return first, second


def assign(
    wanted: Iterable[tuple[int, str | None]], queue: str, shards: int, lengths: Mapping[str, int]
) -> dict[int, str]:
    """The queue of `queue`'s family each email's job goes to: of its mailbox's two shards, the
    one with the fewer jobs (`lengths`, what each holds now, counting the jobs placed here as
    they are), the first one on a tie; the default mailbox's, and every job with no shards,
    the lane queue itself."""
    if shards == 0:
        return {email_id: queue for email_id, _ in wanted}
    held = dict(lengths)
    placed: dict[int, str] = {}
    for email_id, mailbox in wanted:
        if mailbox is None:
            placed[email_id] = queue
            continue
        first, second = (shard_queue(queue, i) for i in shards_of(mailbox, shards))
        chosen = second if held.get(second, 0) < held.get(first, 0) else first
        held[chosen] = held.get(chosen, 0) + 1
        placed[email_id] = chosen
    return placed


def candidates(mailboxes: Iterable[str | None], queue: str, shards: int) -> set[str]:
    """The shard queues of `queue` that jobs of `mailboxes` may go to: whose lengths `assign`
    needs."""
    if shards == 0:
        return set()
    named = (mailbox for mailbox in mailboxes if mailbox is not None)
    return {shard_queue(queue, i) for mailbox in named for i in shards_of(mailbox, shards)}
