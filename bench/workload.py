"""The emails the benchmarks process, reproducible from a seed.

- `mixed_workload`: the shared corpus emails (every one that ingest accepts), generated emails with
  PDF and DOCX attachments taken from the shared corpus documents, and about 10 % copies (an
  earlier email again with one more Received line: other raw bytes, the same origin, so its run
  ends as `duplicate`). What `bench/throughput.py` and `bench/memory.py` use.
- `plain_workload`: short plain-text emails only, the job at its cheapest (`bench/throughput.py
  --workload plain`).
- `small_email`: a short plain-text email, optionally with a small text or CSV attachment; what
  the ingest mbox and the memory benchmark are made of.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.message import EmailMessage
from email.utils import format_datetime
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def _corpus(folder: str) -> Path:
    path = CORPUS / folder
    if not path.is_dir():
        raise SystemExit(f"the shared corpus is not at {path}: the benchmarks read it from there")
    return path


# Documents above this size are left out of the mix: one of them (a 1.8 MB PDF of maps) takes
# about 6 s to convert, so a single draw of it would decide a whole measurement.
MAX_DOCUMENT_BYTES = 1_000_000
COPY_SHARE = 0.10

WORDS = [
    "account",
    "agenda",
    "april",
    "budget",
    "call",
    "client",
    "contract",
    "data",
    "deadline",
    "draft",
    "estimate",
    "feedback",
    "figures",
    "follow",
    "forecast",
    "invoice",
    "meeting",
    "minutes",
    "notes",
    "office",
    "order",
    "payment",
    "plan",
    "project",
    "proposal",
    "quarter",
    "quote",
    "receipt",
    "report",
    "review",
    "schedule",
    "shipment",
    "summary",
    "team",
    "ticket",
    "travel",
    "update",
    "vendor",
    "week",
]
SUBJECTS = (
    "Invoice {n} for {w}",
    "Weekly newsletter: {w} edition {n}",
    "Security alert: new sign-in ({n})",
    "Re: {w} {n}",
    "Ticket #{n}: cannot open the {w}",
    "Invitation: {w} review on Thursday",
    "Your {w} receipt {n}",
    "Minutes of the {w} meeting",
)
BASE_DATE = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)

PDF_TYPE = ("application", "pdf")
DOCX_TYPE = ("application", "vnd.openxmlformats-officedocument.wordprocessingml.document")


def corpus_emails() -> list[bytes]:
    """Every shared corpus email that `mailpipe ingest` would store, read its way."""
    from mailpipe.cli.ingest import RawEmail, read_sources
    from mailpipe.mail.parse import looks_like_email
    from mailpipe.settings import Settings

    accepted = []
    for item in read_sources([_corpus("emails")], max_bytes=Settings().max_email_bytes):
        if isinstance(item, RawEmail) and item.data.strip() and looks_like_email(item.data):
            accepted.append(item.data)
    return accepted


def corpus_documents() -> list[tuple[str, tuple[str, str], bytes]]:
    found = []
    for path in sorted(_corpus("documents").rglob("*")):
        if path.suffix not in (".pdf", ".docx") or path.stat().st_size > MAX_DOCUMENT_BYTES:
            continue
        found.append(
            (path.name, PDF_TYPE if path.suffix == ".pdf" else DOCX_TYPE, path.read_bytes())
        )
    return found


def _body(rng: random.Random, words: int) -> str:
    lines = []
    for _ in range(max(1, words // 12)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return "Hello,\n\n" + "\n".join(lines) + "\n\nBest regards,\nBench Sender\n"


def _headers(message: EmailMessage, rng: random.Random, number: int, tag: str) -> None:
    message["From"] = f"Sender {number % 97} <sender{number % 97}@example{number % 7}.com>"
    message["To"] = f"team{number % 13}@mailpipe.example"
    message["Subject"] = rng.choice(SUBJECTS).format(n=number, w=rng.choice(WORDS))
    message["Date"] = format_datetime(BASE_DATE + timedelta(minutes=number))
    message["Message-ID"] = f"<{tag}-{number}@bench.mailpipe.example>"


def generated_email(
    rng: random.Random,
    number: int,
    documents: list[tuple[str, tuple[str, str], bytes]],
    attachments: int,
    tag: str = "mixed",
) -> bytes:
    message = EmailMessage()
    _headers(message, rng, number, tag)
    message.set_content(_body(rng, rng.randint(20, 200)))
    for _ in range(attachments):
        name, (maintype, subtype), data = rng.choice(documents)
        message.add_attachment(data, maintype=maintype, subtype=subtype, filename=name)
    return message.as_bytes()


def small_email(rng: random.Random, number: int, attachment: bool, tag: str = "small") -> bytes:
    message = EmailMessage()
    _headers(message, rng, number, tag)
    message.set_content(_body(rng, rng.randint(20, 120)))
    if attachment:
        if rng.random() < 0.5:
            rows = "\n".join(f"{i},{rng.choice(WORDS)},{rng.randint(1, 999)}" for i in range(20))
            message.add_attachment(
                ("id,item,amount\n" + rows).encode(),
                maintype="text",
                subtype="csv",
                filename=f"items-{number}.csv",
            )
        else:
            message.add_attachment(
                _body(rng, 60).encode(),
                maintype="text",
                subtype="plain",
                filename=f"notes-{number}.txt",
            )
    return message.as_bytes()


def copy_of(raw: bytes, number: int) -> bytes:
    """The same email delivered again: one more Received line, so other bytes, the same origin."""
    newline = b"\r\n" if b"\r\n" in raw[:2000] else b"\n"
    received = (
        f"Received: from relay{number}.bench.mailpipe.example by mx.bench.mailpipe.example; "
        f"{format_datetime(BASE_DATE)}"
    ).encode()
    return received + newline + raw


def plain_workload(total: int, seed: int = 8) -> tuple[list[bytes], dict[str, int]]:
    """`total` short plain-text emails, no attachment and no copy: the job at its cheapest."""
    rng = random.Random(seed)
    emails = [small_email(rng, number, attachment=False, tag="plain") for number in range(total)]
    return emails, {"plain": total}


def mixed_workload(total: int, seed: int = 8) -> tuple[list[bytes], dict[str, int]]:
    """`total` emails: the corpus, generated ones with documents, ~10 % copies; shuffled."""
    rng = random.Random(seed)
    corpus = corpus_emails()
    documents = corpus_documents()
    copies = round(total * COPY_SHARE)
    originals = total - copies
    picked_corpus = corpus[: min(len(corpus), originals)]
    generated = []
    kinds = {"corpus": len(picked_corpus), "plain": 0, "one_document": 0, "two_documents": 0}
    for number in range(originals - len(picked_corpus)):
        draw = rng.random()
        attachments = 0 if draw < 0.25 else 1 if draw < 0.85 else 2
        kinds[("plain", "one_document", "two_documents")[attachments]] += 1
        generated.append(generated_email(rng, number, documents, attachments))
    emails = picked_corpus + generated
    rng.shuffle(emails)
    copied = [copy_of(emails[rng.randrange(len(emails))], n) for n in range(copies)]
    kinds["copies"] = len(copied)
    # Copies come after their originals in the queue, as re-deliveries do.
    return emails + copied, kinds
