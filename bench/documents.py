"""Benchmark of attachment conversion: throughput against the bare libraries, and peak memory on
hostile inputs.

    .venv/bin/python -m bench.documents [--repeat 5] [--json results.json]

1. Throughput. The shared corpus's PDFs and DOCX files, converted side by side in one run by
   `convert_attachment` and by the bare library loop it wraps (pypdf: PdfReader + extract_text
   per page; python-docx: Document + paragraph text). Each pass converts every file once; the
   median of `--repeat` passes is reported, with the ratio (wrapper time / bare time). The files
   the bare loop cannot read (encrypted, broken) are timed in both, as a worker meets them.
2. Memory. Each hostile input is converted in a fresh interpreter that receives the payload on
   stdin; its peak RSS (VmHWM) after converting is compared with the same high-water mark just
   before (interpreter, imports and payload: the baseline a worker child has anyway). A benign
   row, the corpus's largest PDF, gives the scale.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import docx
import pypdf

# The hostile inputs are the tests' own builders, so the bench measures exactly what is tested.
import tests.support.document_samples as samples
from bench.report import table
from mailpipe.mail.documents import DocumentLimits, convert_attachment
from mailpipe.mail.parse import Attachment

_SPEED_COLUMNS = [
    "corpus",
    "files",
    "mb",
    "convert_docs_per_s",
    "convert_mb_per_s",
    "bare_docs_per_s",
    "bare_mb_per_s",
    "ratio_convert_to_bare_time",
    "convert_not_converted",
    "bare_raised",
]
_MEMORY_COLUMNS = [
    "input",
    "payload_bytes",
    "status",
    "baseline_mib",
    "peak_mib",
    "growth_mib",
    "error",
]
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"


def bare_pdf(payload: bytes) -> str:
    reader = pypdf.PdfReader(io.BytesIO(payload))
    return "\n".join(page.extract_text() for page in reader.pages)


def bare_docx(payload: bytes) -> str:
    document = docx.Document(io.BytesIO(payload))
    return "\n".join(paragraph.text for paragraph in document.paragraphs)


def _bare_pass(files: list[tuple[str, bytes]], read: Callable[[bytes], str]) -> tuple[float, int]:
    """Seconds for one pass, and the number of files the library raised on."""
    unread = 0
    started = time.perf_counter()
    for _, payload in files:
        try:
            read(payload)
        except Exception:
            unread += 1
    return time.perf_counter() - started, unread


def _wrapped_pass(files: list[tuple[str, bytes]]) -> tuple[float, int]:
    """Seconds for one pass, and the number of files not converted."""
    unread = 0
    started = time.perf_counter()
    for index, (name, payload) in enumerate(files):
        document = convert_attachment(
            samples.attachment(payload, "application/octet-stream", name, index=index),
            samples.DEFAULT_LIMITS,
        )
        unread += document.status != "converted"
    return time.perf_counter() - started, unread


def throughput(repeat: int) -> list[dict[str, object]]:
    rows = []
    corpora = {
        "pdf": (samples.corpus_files("pdf-sample-files/**/*.pdf"), bare_pdf),
        "docx": (samples.corpus_files("python-docx/**/*.docx"), bare_docx),
    }
    for label, (paths, bare) in corpora.items():
        files = [(path.name, path.read_bytes()) for path in paths]
        megabytes = sum(len(payload) for _, payload in files) / 1e6
        wrapped_times, bare_times = [], []
        for _ in range(repeat):  # interleaved, so that drift in the machine hits both alike
            seconds, convert_unread = _wrapped_pass(files)
            wrapped_times.append(seconds)
            seconds, bare_unread = _bare_pass(files, bare)
            bare_times.append(seconds)
        wrapped, plain = statistics.median(wrapped_times), statistics.median(bare_times)
        rows.append(
            {
                "corpus": label,
                "files": len(files),
                "mb": round(megabytes, 2),
                "convert_docs_per_s": round(len(files) / wrapped, 1),
                "convert_mb_per_s": round(megabytes / wrapped, 2),
                "bare_docs_per_s": round(len(files) / plain, 1),
                "bare_mb_per_s": round(megabytes / plain, 2),
                "ratio_convert_to_bare_time": round(wrapped / plain, 3),
                "convert_not_converted": convert_unread,
                "bare_raised": bare_unread,
                "convert_median_s": round(wrapped, 4),
                "bare_median_s": round(plain, 4),
            }
        )
    return rows


def hostile_inputs() -> list[tuple[str, Attachment, DocumentLimits]]:
    """(name, attachment, limits): built at run time, with the default limits unless noted."""
    limits = samples.DEFAULT_LIMITS
    pdf, html = "application/pdf", "text/html"
    geotopo = samples.corpus_files("pdf-sample-files/**/GeoTopo-komprimiert.pdf")[0]
    inputs = [
        ("reference: largest corpus PDF", geotopo.read_bytes(), pdf, limits),
        ("docx zip bomb (64 MiB of zeros)", samples.docx_zip_bomb(64), DOCX, limits),
        ("docx bomb entry behind images", samples.docx_hidden_bomb(), DOCX, limits),
        ("docx with 17 MB document.xml", samples.docx_bytes(_random_paragraphs(17)), DOCX, limits),
        ("xlsx billion laughs", samples.xlsx_billion_laughs(), XLSX, limits),
        ("pdf stream inflating to 256 MiB", samples.pdf_stream_bomb(256), pdf, limits),
        ("pdf with 600 pages", samples.pdf_with_pages(600), pdf, limits),
        ("slow pdf, time limit 1 s", samples.pdf_slow(30), pdf, replace(limits, time_limit=1.0)),
        ("html, 20 MB of <p> tags", b"<p>word</p>" * (20 * 1024 * 1024 // 11), html, limits),
        ("1000 nested attached emails", samples.nested_email(1000), "message/rfc822", limits),
        ("30 nested attached emails", samples.nested_email(30), "message/rfc822", limits),
    ]
    return [
        (name, samples.attachment(payload, content_type, "input"), input_limits)
        for name, payload, content_type, input_limits in inputs
    ]


def _random_paragraphs(megabytes: int) -> list[str]:
    """Text that compresses about 2:1, so that no ratio check stops it before the part size."""
    return [os.urandom(8 * 1024).hex() for _ in range(megabytes * 1_000_000 // (16 * 1024))]


def memory() -> list[dict[str, object]]:
    rows = []
    for name, att, limits in hostile_inputs():
        outcome = samples.measure_in_child(att, limits)
        rows.append(
            {
                "input": name,
                "payload_bytes": len(att.payload),
                "status": outcome["status"],
                "error": outcome["error"],
                "baseline_mib": round(outcome["baseline_mib"], 1),
                "peak_mib": round(outcome["peak_mib"], 1),
                "growth_mib": round(outcome["growth_mib"], 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="passes over the corpus (median)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()

    machine = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "pypdf": version("pypdf"),
        "python-docx": version("python-docx"),
        "openpyxl": version("openpyxl"),
        "repeat": args.repeat,
    }
    speed = throughput(args.repeat)
    peaks = memory()

    print("machine:", ", ".join(f"{key} {value}" for key, value in machine.items()))
    print("\nthroughput, median of", args.repeat, "passes (ratio = convert time / bare time)")
    print(table(speed, _SPEED_COLUMNS))
    print("\npeak RSS of a fresh child converting each hostile input (MiB)")
    print(table(peaks, _MEMORY_COLUMNS))
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine, "throughput": speed, "memory": peaks}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
