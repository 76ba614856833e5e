"""The email search: `mailpipe find`, the console's search page and box, and `GET /api/search`.

One parser, `read_search`, turns a mapping of strings (a query string, a form, the CLI's options)
into an `EmailFilter` and a page's position, or refuses it with every problem in one line; its
sibling `read_failed` reads the failed list's `FailedFilter` with the same values' rules, times and
messages, so that `mailpipe failed`, `/failed` and `/api/failed` take the same strings. One
function, `find`, answers a filter with a page of emails, the newest (highest id) first; the
next page starts below the page's last id (keyset, so that every page costs what the first does).

Where each filter reads, and the index it needs, is in docs/decisions/search-indexes.md. The
Message-ID, sender and subject are what an email's job read from its headers (the origin step),
so an email no job has read yet is found by its id, time, state, lane, review mark or mailbox
only. On PostgreSQL the sender and subject match whole words (full text, any case), each email
checked first by at most PART_CHARS characters of the query, never by the whole of it: their
text is an outsider's, and a check of the query anywhere in it costs its length times the
query's per email (docs/decisions/search-load.md). On SQLite, the demo's database, the text
anywhere in them.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce
from typing import Any

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Text,
    bindparam,
    exists,
    func,
    literal_column,
    not_,
    select,
    text,
    union_all,
)
from sqlalchemy.orm import Session, aliased

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane, Stage
from mailpipe.mail.headers import normalise_message_id
from mailpipe.operations.status import FailedFilter, in_mailbox
from mailpipe.storage.models import (
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    PipelineRun,
    RunStatus,
    sender_words,
    subject_words,
)

PER_PAGE = 50
# The run states a search tells apart: the run's status, a failed run an operator dismissed
# apart from the failed ones (as the failed list has it), and an email no run was made for yet.
NO_RUN = "no_run"
DISMISSED = "dismissed"
STATES = (NO_RUN, *(status.value for status in RunStatus), DISMISSED)
# What a query string, a form or the CLI may give, in the order the form shows them; `q` is the
# search box's text (`_box_fields`) and `before` the page's position.
FIELDS = (
    "message_id",
    "sender",
    "subject",
    "since",
    "until",
    "state",
    "error_class",
    "label",
    "lane",
    "review",
    "mailbox",
)
KEYS = ("q", *FIELDS, "before")
# What the failed list's filter reads; `view=dismissed` lists the runs an operator dismissed. The
# other keys of a query or form (its page, its token) are its face's to read.
FAILED_FIELDS = ("error_class", "stage", "since", "until", "mailbox", "view")
# Ids are PostgreSQL bigints: a number past them is refused here, not by the database.
MAX_ID = 2**63 - 1
# Longer than any header a search could match (a header line is at most 998 characters) and
# than the columns (an error class and a label are at most 64); a mailbox's name as
# `mailboxes.checked` takes it.
MAX_CHARS = {
    "message_id": 998,
    "sender": 998,
    "subject": 998,
    "error_class": 64,
    "label": 64,
    "mailbox": mailboxes.MAX_NAME_CHARS,
}
# What the search box's text names a mailbox with: `mailbox:NAME`, beside the rest of its text.
MAILBOX_PREFIX = "mailbox:"

MAX_WORDS = 10
# What `_holds_part` checks of a word before its full text is: enough for an address or a domain
# to rule out most emails, and a bound on what the check costs per email whatever its text.
PART_CHARS = 16
# ISO 8601, as `datetime.fromisoformat` reads it; a time without an offset (or `Z`) is UTC, as
# every time mailpipe stores is.
TIME_FORMAT = "a date or a date and time, as 2026-01-31 or 2026-01-31T14:00 (UTC unless given)"
TIME_RANGE = f"{datetime.min.date().isoformat()} to {datetime.max.date().isoformat()}"
_YES = ("yes", "true", "1", "on")
_NO = ("no", "false", "0", "off")


class BadSearch(ValueError):
    """What in a search, of the emails or of the failed list, could not be read, every problem
    in one line."""


@dataclass(frozen=True)
class EmailFilter:
    """Which emails a search finds: every field given, at once (None or empty: any)."""

    email_id: int | None = None
    message_id: str | None = None  # normalised, as origins store it
    sender: str | None = None  # text of the From header, any case
    subject: tuple[str, ...] = ()  # each word in the subject, any case
    since: datetime | None = None  # received_at >= since (naive UTC)
    until: datetime | None = None  # received_at < until (naive UTC)
    state: str | None = None  # one of STATES
    error_class: str | None = None  # the run's, whatever its status
    label: str | None = None
    lane: Lane | None = None
    review: bool | None = None  # marked for review, or not
    mailbox: str | None = None  # as shown and typed: "default" is the emails without one

    def fields(self) -> dict[str, str]:
        """The filter as the search's form and its links carry it (FIELDS, empty when unset)."""
        values = {
            "message_id": self.message_id,
            "sender": self.sender,
            "subject": " ".join(self.subject),
            "since": _shown_time(self.since),
            "until": _shown_time(self.until),
            "state": self.state,
            "error_class": self.error_class,
            "label": self.label,
            "lane": None if self.lane is None else self.lane.value,
            "review": None if self.review is None else ("yes" if self.review else "no"),
            "mailbox": self.mailbox,
        }
        return {name: value or "" for name, value in values.items()}

    def names(self) -> list[str]:
        """The names of the fields given, the email id's included: what a log line or a stored
        reprocess keeps of the filter, since its values may be an email's sender or subject."""
        given = [name for name, value in self.fields().items() if value]
        return (["email_id"] if self.email_id is not None else []) + given

    @property
    def reads_headers(self) -> bool:
        """Whether it finds only emails whose headers a job has read."""
        return bool(self.message_id or self.sender or self.subject)

    def where(self, full_text: bool = False) -> list[ColumnElement[bool]]:
        """The conditions on `email_message` of the emails it finds (its run's and labels' as
        EXISTS, so that the ids are found and sorted in that table alone).

        With `full_text` (PostgreSQL), the sender holds its text, and the subject each of its
        words, as words of their full-text indexes, one after another, which the indexes find;
        each is checked first by a few characters of it anywhere (`_holds_part`), what every
        email the words find holds and what a walk of the newest emails checks at little cost.
        Without (SQLite, which has no such index), the text anywhere, in any case."""
        email = EmailMessage
        conditions: list[ColumnElement[bool]] = []
        if self.email_id is not None:
            conditions.append(email.id == self.email_id)
        if self.message_id is not None:
            conditions.append(email.id.in_(_with_message_id(self.message_id)))
        if self.sender is not None and full_text:
            conditions.append(_holds_part(email.sender, self.sender))
            conditions.append(_has_words(sender_words(email.sender), [self.sender]))
        elif self.sender is not None:
            conditions.append(email.sender.ilike(_contains(self.sender), escape="\\"))
        if self.subject and full_text:
            conditions += [_holds_part(email.subject, word) for word in self.subject]
            conditions.append(_has_words(subject_words(email.subject), self.subject))
        else:
            conditions += [email.subject.ilike(_contains(w), escape="\\") for w in self.subject]
        if self.since is not None:
            conditions.append(email.received_at >= self.since)
        if self.until is not None:
            conditions.append(email.received_at < self.until)
        if self.state == NO_RUN:
            # The bare column, as the partial index over the emails without a run is written.
            conditions.append(not_(email.has_run))
        of_run = [] if self.state in (None, NO_RUN) else _in_state(self.state)
        if self.error_class is not None:
            of_run.append(PipelineRun.error_class == self.error_class)
        if of_run:
            conditions.append(exists().where(PipelineRun.email_id == email.id, *of_run))
        if self.label is not None:
            conditions.append(
                exists().where(EmailLabel.email_id == email.id, EmailLabel.label == self.label)
            )
        if self.lane is not None:
            # Written out, as the partial index over the bulk lane is: a plan cached for a
            # parameter could not use it.
            conditions.append(email.lane == _literal("lane", self.lane.value))
        if self.review is not None:
            # The bare column, as the partial index over the marked emails is written.
            marked = email.needs_review.expression
            conditions.append(marked if self.review else not_(marked))
        if self.mailbox is not None:
            conditions.append(in_mailbox(self.mailbox))
        return conditions


def _with_message_id(message_id: str) -> Any:
    """The ids of the emails whose origin has this Message-ID: each origin's first email and
    the copies linked to it (`pipeline/origin.py`), both found by indexes `email_message` has
    for other reasons, so that this filter adds none to the table every ingest writes."""
    firsts = select(EmailOrigin.first_email_id).where(EmailOrigin.message_id == message_id)
    copy = aliased(EmailMessage)
    return union_all(firsts, select(copy.id).where(copy.duplicate_of.in_(firsts)))


def _in_state(state: str) -> list[ColumnElement[bool]]:
    """The conditions on the run of an email in `state` (a state with a run)."""
    run = PipelineRun
    if state == DISMISSED:
        return [run.status == _status(RunStatus.FAILED), run.dismissed_at.is_not(None)]
    status = RunStatus(state)
    if status is RunStatus.FAILED:
        return [run.status == _status(status), run.dismissed_at.is_(None)]
    return [run.status == _status(status)]


def _status(status: RunStatus) -> Any:
    # Written out, as the partial indexes over the open, duplicate and failed runs are.
    return _literal("status", status.value)


def _literal(name: str, value: str) -> Any:
    return bindparam(f"{name}_{value}", value, literal_execute=True)


# The full-text configuration of the indexes' words (`models.subject_words`).
_SIMPLE: ColumnElement[Any] = literal_column("'simple'::regconfig")
# What `_holds_part` writes around a word's part, and for a word the full text has none of.
_ANYWHERE: ColumnElement[str] = literal_column("'%'", Text)
_NOTHING: ColumnElement[Any] = literal_column("''")
_LEXEMES = ARRAY(Text)
# regexp_replace's pattern, replacement and flags: LIKE's escape and wildcards, each escaped.
_WILDCARDS: tuple[ColumnElement[Any], ...] = (
    literal_column(r"'([\\%_])'"),
    literal_column(r"'\\\1'"),
    literal_column("'g'"),
)


def _has_words(words: Any, given: Sequence[str]) -> ColumnElement[bool]:
    """Whether `words` (a tsvector) holds each of `given`, its words read as the index's words
    are and one after another (`phraseto_tsquery`: `2026-0142` is `2026` then `-0142`)."""
    queries: list[Any] = [func.phraseto_tsquery(_SIMPLE, text_) for text_ in given]
    return words.bool_op("@@")(reduce(lambda both, one: both.op("&&")(one), queries))


def _holds_part(column: Any, given: str) -> ColumnElement[bool]:
    """Whether `column` holds, anywhere and in any case, the first PART_CHARS characters of the
    first word of `given` as the full text reads it (its lowest, in PostgreSQL's order): a word
    of an email's text is a part of it, so every email whose words hold `given` holds this. It
    costs at most PART_CHARS comparisons per character of the column, however long `given`, and
    PostgreSQL works it out from `given` when it plans (every function here is immutable), so
    that its estimates read a pattern, as they would a written one."""
    words = func.tsvector_to_array(func.to_tsvector(_SIMPLE, given), type_=_LEXEMES)
    part = func.coalesce(func.left(words[1], PART_CHARS), _NOTHING)
    pattern = _ANYWHERE.concat(func.regexp_replace(part, *_WILDCARDS)).concat(_ANYWHERE)
    return column.ilike(pattern, escape="\\")


def _contains(text_: str) -> str:
    """A LIKE pattern that finds `text_` anywhere, its wildcards taken as they are."""
    escaped = text_.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


@dataclass(frozen=True)
class Found:
    rows: list[dict[str, Any]]
    # The `before` of the next page: the last row's id; None on the last page.
    next_before: int | None

    def as_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "next_before": self.next_before}


def find(
    session: Session, filt: EmailFilter, before: int | None = None, per_page: int = PER_PAGE
) -> Found:
    """The emails `filt` finds with an id below `before` (all: None), the newest first, at most
    `per_page`: their ids first, from `email_message` alone, then what the page shows of them."""
    email = EmailMessage
    conditions = matching(session, filt)
    newest = email.id.desc()
    if (filt.since or filt.until) and _few_received(session, filt):
        # Sorted by a copy of the id, so that the planner cannot walk the primary key from the
        # newest email, through every email received after the range (it takes emails for
        # spread evenly over time): the range is read from its index and sorted.
        newest = (email.id + 0).desc()
    ids = select(email.id).where(*conditions).order_by(newest).limit(per_page + 1)
    if before is not None:
        ids = ids.where(email.id < before)
    found = list(session.scalars(ids))
    return Found(
        _rows(session, found[:per_page]), found[per_page - 1] if found[per_page:] else None
    )


def matching(session: Session, filt: EmailFilter) -> list[ColumnElement[bool]]:
    """`filt`'s conditions on `email_message` as the search applies them in `session`'s
    transaction, for whatever else reads the emails a search finds (a reprocess): on PostgreSQL,
    words as whole words through the full-text indexes, and planned for these values."""
    postgresql = session.get_bind().dialect.name == "postgresql"
    if postgresql:
        # Planned for the values given each time (psycopg prepares a statement run five times,
        # and the plan PostgreSQL may then keep for one sender or word would serve every other),
        # and in this process alone (a word and the failed runs: 113 ms with two parallel
        # workers, 23 ms without, at a million emails on two CPUs).
        session.execute(_SEARCH_SETTINGS)
    return filt.where(full_text=postgresql)


# For this transaction only (set_config's third argument), in one round trip.
_SEARCH_SETTINGS = text(
    "SELECT set_config('plan_cache_mode', 'force_custom_plan', true), "
    "set_config('max_parallel_workers_per_gather', '0', true)"
)
# A received time range with at most this many emails is read from its index and sorted; a
# wider one is walked from the newest email (docs/decisions/search-indexes.md).
FEW_RECEIVED = 50_000


def _few_received(session: Session, filt: EmailFilter) -> bool:
    """Whether the filter's time range holds FEW_RECEIVED emails or fewer, counted from the
    index on `received_at` up to one more."""
    email = EmailMessage
    in_range = [email.received_at >= filt.since] if filt.since else []
    in_range += [email.received_at < filt.until] if filt.until else []
    counted = select(email.id).where(*in_range).limit(FEW_RECEIVED + 1).subquery()
    return (session.scalar(select(func.count()).select_from(counted)) or 0) <= FEW_RECEIVED


def _rows(session: Session, ids: list[int]) -> list[dict[str, Any]]:
    """What the results show of each email of `ids`, the newest first."""
    email, run = EmailMessage, PipelineRun
    query = (
        select(
            email.id,
            email.received_at,
            email.sender,
            email.subject,
            email.lane,
            email.mailbox,
            email.needs_review,
            run.status,
            run.dismissed_at,
            run.error_class,
        )
        .outerjoin(run, run.email_id == email.id)
        .where(email.id.in_(ids))
        .order_by(email.id.desc())
    )
    return [
        {
            "email_id": row.id,
            "received_at": _iso(row.received_at),
            "sender": row.sender,
            "subject": row.subject,
            "lane": row.lane,
            "mailbox": mailboxes.shown(row.mailbox),
            "state": _state_of(row.status, row.dismissed_at),
            "error_class": row.error_class,
            "needs_review": row.needs_review,
        }
        for row in session.execute(query)
    ]


def _state_of(status: RunStatus | None, dismissed_at: datetime | None) -> str:
    if status is None:
        return NO_RUN
    if status is RunStatus.FAILED and dismissed_at is not None:
        return DISMISSED
    return status.value


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat() + "Z"


# --- reading a search ------------------------------------------------------------------------


@dataclass
class _Reading:
    """The values of one search as they are read, and what could not be."""

    values: Mapping[str, str]
    problems: list[str] = field(default_factory=list)

    def text(self, name: str) -> str | None:
        value = (self.values.get(name) or "").strip()
        if not value:
            return None
        if _unreadable(value):
            self.problems.append(f"{name} is text without control characters, in UTF-8")
            return None
        most = MAX_CHARS.get(name)
        if most is not None and len(value) > most:
            self.problems.append(f"{name} is at most {most} characters")
            return None
        return value

    def in_order(self, since: datetime | None, until: datetime | None) -> None:
        if since and until and since >= until:
            self.problems.append("since is earlier than until")

    def done(self) -> None:
        if self.problems:
            raise BadSearch("; ".join(self.problems))


def read_search(values: Mapping[str, str]) -> tuple[EmailFilter, int | None]:
    """The filter and the page's position (`before`) of a query string, a form or the CLI's
    options, each a string; empty ones are left out. Raises BadSearch naming every problem."""
    reading = _Reading(values)
    unknown = sorted(key for key in values if key not in KEYS)
    if unknown:
        reading.problems.append(f"unknown filter {', '.join(unknown)} (known: {', '.join(KEYS)})")
    given = {name: reading.text(name) for name in (*FIELDS, "q", "before")}
    box = given.pop("q")
    if box is not None:
        given.update(_box_fields(box, given, reading.problems))
    filt = EmailFilter(
        email_id=_whole_number(given.pop("email_id", None), "an email id", reading.problems),
        message_id=_message_id(given["message_id"], reading.problems),
        sender=_sender(given["sender"], reading.problems),
        subject=_words(given["subject"], reading.problems),
        since=_time(given["since"], "since", reading.problems),
        until=_time(given["until"], "until", reading.problems),
        state=_choice(given["state"], "state", STATES, reading.problems),
        error_class=given["error_class"],
        label=given["label"],
        lane=_lane(given["lane"], reading.problems),
        review=_yes_or_no(given["review"], reading.problems),
        mailbox=_mailbox(given["mailbox"], reading.problems),
    )
    before = _whole_number(given["before"], "before", reading.problems)
    reading.in_order(filt.since, filt.until)
    reading.done()
    return filt, before


def read_failed(values: Mapping[str, str]) -> FailedFilter:
    """The failed list's filter of a query string, a form or the CLI's options, each a string;
    empty ones are left out, and so are the keys not in FAILED_FIELDS. Raises BadSearch naming
    every problem."""
    reading = _Reading(values)
    given = {name: reading.text(name) for name in FAILED_FIELDS}
    stage = _choice(
        given["stage"], "stage", tuple(stage.value for stage in Stage), reading.problems
    )
    view = _choice(given["view"], "view", ("dismissed",), reading.problems)
    filt = FailedFilter(
        error_class=given["error_class"],
        stage=None if stage is None else Stage(stage),
        since=_time(given["since"], "since", reading.problems),
        until=_time(given["until"], "until", reading.problems),
        dismissed=view is not None,
        mailbox=_mailbox(given["mailbox"], reading.problems),
    )
    reading.in_order(filt.since, filt.until)
    reading.done()
    return filt


def failed_fields(filt: FailedFilter) -> dict[str, str]:
    """The failed list's filter as its form and links carry it (FAILED_FIELDS, empty when
    unset), which `read_failed` reads back."""
    values = {
        "error_class": filt.error_class,
        "stage": None if filt.stage is None else filt.stage.value,
        "since": _shown_time(filt.since),
        "until": _shown_time(filt.until),
        "mailbox": filt.mailbox,
        "view": "dismissed" if filt.dismissed else None,
    }
    return {name: value or "" for name, value in values.items()}


def _box_fields(box: str, given: dict[str, str | None], problems: list[str]) -> dict[str, str]:
    """What the search box's text stands for: a mailbox (`mailbox:NAME`, a word of it), and
    what the rest is: an email id (digits), a Message-ID (in angle brackets), a sender (an
    address: it has an @), or else words of the subject."""
    words = box.split()
    named = [word for word in words if word.startswith(MAILBOX_PREFIX)]
    if not named:
        return _box_text(box, given, problems)
    fields: dict[str, str] = {}
    if len(named) > 1 or given["mailbox"] is not None:
        problems.append("q and mailbox give one mailbox between them: give it once")
    else:
        fields["mailbox"] = named[0].removeprefix(MAILBOX_PREFIX)
    rest = " ".join(word for word in words if not word.startswith(MAILBOX_PREFIX))
    return {**fields, **(_box_text(rest, given, problems) if rest else {})}


def _box_text(box: str, given: dict[str, str | None], problems: list[str]) -> dict[str, str]:
    """What the search box's text, its mailbox aside, stands for (`_box_fields`)."""
    if box.isascii() and box.isdigit():
        return {"email_id": box}
    if box.startswith("<") and box.endswith(">"):
        name = "message_id"
    elif "@" in box:
        name = "sender"
    else:
        name = "subject"
    if given[name] is not None:
        problems.append(f"q and {name} both give the {name}: give one")
        return {}
    return {name: box}


def _whole_number(value: str | None, name: str, problems: list[str]) -> int | None:
    if value is None:
        return None
    if value.isascii() and value.isdigit() and len(value) <= len(str(MAX_ID)):
        number = int(value)
        if 1 <= number <= MAX_ID:
            return number
    problems.append(f"{name} is a whole number from 1 to {MAX_ID}")
    return None


def _message_id(value: str | None, problems: list[str]) -> str | None:
    if value is None:
        return None
    normalised = normalise_message_id(value)
    if normalised is None:
        problems.append("message_id is a Message-ID, as <id@host>")
    return normalised


def _words(value: str | None, problems: list[str]) -> tuple[str, ...]:
    if value is None or not _has_a_word(value, "subject", problems):
        return ()
    words = value.split()
    if len(words) > MAX_WORDS:
        problems.append(f"subject is at most {MAX_WORDS} words")
        return ()
    return tuple(words)


def _sender(value: str | None, problems: list[str]) -> str | None:
    return value if value is not None and _has_a_word(value, "sender", problems) else None


def _has_a_word(value: str, name: str, problems: list[str]) -> bool:
    if any(char.isalnum() for char in value):
        return True
    problems.append(f"{name} has a word (a letter or a digit)")
    return False


def _time(value: str | None, name: str, problems: list[str]) -> datetime | None:
    """`value` as naive UTC, as the database keeps times: one with an offset converted, one
    without taken as UTC."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        problems.append(f"{name} is {TIME_FORMAT}")
        return None
    if parsed.tzinfo is not None:
        try:
            parsed = parsed.astimezone(UTC).replace(tzinfo=None)
        except OverflowError:
            # 0001-01-01T00:00+01:00 is 0000-12-31T23:00 in UTC: a year before any datetime holds.
            problems.append(f"{name} is out of range: from {TIME_RANGE} in UTC")
            return None
    return parsed


def _shown_time(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.isoformat(timespec="seconds" if value.second or value.microsecond else "minutes")


def _choice(
    value: str | None, name: str, allowed: tuple[str, ...], problems: list[str]
) -> str | None:
    if value is None or value in allowed:
        return value
    problems.append(f"{name} is one of {', '.join(allowed)}")
    return None


def _mailbox(value: str | None, problems: list[str]) -> str | None:
    """A mailbox's name as shown and typed ("default" included), checked as ingest checks it;
    what is wrong is said without the name."""
    if value is None:
        return None
    try:
        return mailboxes.checked(value)
    except ValueError as exc:
        problems.append(f"mailbox: {exc}")
        return None


def _lane(value: str | None, problems: list[str]) -> Lane | None:
    chosen = _choice(value, "lane", tuple(lane.value for lane in Lane), problems)
    return None if chosen is None else Lane(chosen)


def _yes_or_no(value: str | None, problems: list[str]) -> bool | None:
    if value is None:
        return None
    if value.lower() in _YES:
        return True
    if value.lower() in _NO:
        return False
    problems.append("review is yes or no")
    return None


def _unreadable(value: str) -> bool:
    """Whether `value` holds a control character (NUL, which PostgreSQL's text refuses, among
    them) or a byte that was not UTF-8 (decoded as U+FFFD)."""
    return any(unicodedata.category(char) == "Cc" or char == "\ufffd" for char in value)
