"""Screenshot of Flower for docs/metrics.md: a worker, finished and failed jobs, behind basic auth.

    .venv/bin/python docs/tools/flower_screenshot.py [--out docs/img/flower.png]

Starts Flower from the repository root as the Procfile does (`--conf=./flowerconfig.py`; loopback
port, basic auth with a throwaway password), a real prefork worker on a SQLite file and a blob
folder in a temporary directory and the local Redis under a key prefix of its own, and runs the
bundled demo emails, one empty email and two jobs for email ids that do not exist (their runs
fail, and their tasks raise RunFailed: FAILURE in Flower). Headless Chromium takes the Broker page while
the jobs wait (before the worker starts), then the Workers and Tasks pages once they have run;
the three are stacked into one PNG.

Basic auth: Chromium accepts the credentials in the URL (http://user:password@host/) for the
page and reuses them for the page's own requests to the same origin. Each page is first loaded
with --dump-dom to check it rendered behind the credentials rather than Flower's 401 page.
Needs Debian's `chromium` (apt-get install chromium); the tests do not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from importlib import resources as package_files
from pathlib import Path

import requests
from PIL import Image, ImageChops

from mailpipe.cli.demo import fleet
from mailpipe.cli.demo.servers import free_port
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.resources import get_resources
from mailpipe.storage import flags
from mailpipe.storage.migrate import upgrade
from tests.support.services import delete_prefix

REPO = Path(__file__).resolve().parents[2]
WORK = Path(tempfile.mkdtemp(prefix="mailpipe-flower-shot-"))
PASSWORD = uuid.uuid4().hex
ENV = {
    "MAILPIPE_DATABASE_URL": f"sqlite:///{WORK / 'mailpipe.db'}",
    "MAILPIPE_BLOB_URL": f"file://{WORK / 'blobs'}",
    "MAILPIPE_BROKER_URL": os.environ.get("MAILPIPE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9"),
    "MAILPIPE_REDIS_PREFIX": f"flowershot{os.getpid()}:",
    "MAILPIPE_FLOWER_BASIC_AUTH": f"ops:{PASSWORD}",
}
# Read when the settings are first used, after these imports.
os.environ.update(ENV)

UNKNOWN_IDS = [424242, 434343]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--window-size=1600,900",
    # Lets the page's own requests (the workers and tasks tables) finish before the shot.
    "--virtual-time-budget=4000",
]


def chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        sys.exit("chromium is not installed: apt-get install -y chromium")
    profile = tempfile.mkdtemp(prefix="chromium-", dir=WORK)
    return subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def shoot(base: str, path: str, must_show: str) -> Image.Image:
    url = f"http://ops:{PASSWORD}@{base.removeprefix('http://')}{path}"
    dom = chromium(url, "--dump-dom").stdout
    if must_show not in dom:
        sys.exit(f"{path} did not render {must_show!r} behind basic auth; it was:\n{dom[:2000]}")
    target = WORK / f"{path.strip('/') or 'workers'}.png"
    chromium(url, f"--screenshot={target}")
    image = Image.open(target).convert("RGB")
    # Crop the empty page background below the content.
    background = Image.new("RGB", image.size, image.getpixel((image.width - 1, image.height - 1)))
    box = ImageChops.difference(image, background).getbbox()
    bottom = min(image.height, (box[3] if box else image.height) + 24)
    return image.crop((0, 0, image.width, bottom))


def wait_until_up(base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base}/healthcheck", timeout=2).ok:
                return
        except requests.ConnectionError:
            time.sleep(0.2)
    sys.exit(f"Flower did not start; its log:\n{(WORK / 'flower.log').read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "flower.png")
    args = parser.parse_args()

    upgrade(ENV["MAILPIPE_DATABASE_URL"])
    res = get_resources()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with (WORK / "flower.log").open("wb") as log:
        flower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "mailpipe",
                "flower",
                "--conf=./flowerconfig.py",
                "--address=127.0.0.1",
                f"--port={port}",
            ],
            cwd=REPO,
            env=dict(os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    worker = fleet.worker(dict(os.environ), WORK, concurrency=2, name="worker-1")
    worker.cwd = REPO  # like Flower, from the repository root: this checkout's code
    try:
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        folder = package_files.files("mailpipe.cli.demo") / "emails"
        emls = sorted(
            (item for item in folder.iterdir() if item.name.endswith(".eml")),
            key=lambda item: item.name,
        )
        raws = [item.read_bytes() for item in emls]
        ids = store_emails(res, [*raws, b""])
        auth = ("ops", PASSWORD)
        wait_until_up(base)
        # The queue before any worker takes from it (read through the key prefix).
        enqueue_emails(ids + UNKNOWN_IDS, res)
        broker = shoot(base, "/broker", "mailpipe.control")
        worker.start().wait_ready()
        expected = len(ids) + len(UNKNOWN_IDS)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            tasks = requests.get(f"{base}/api/tasks", auth=auth, timeout=5).json()
            if sum(task["state"] in ("SUCCESS", "FAILURE") for task in tasks.values()) >= expected:
                break
            time.sleep(0.5)
        else:
            sys.exit(f"the jobs did not finish; the worker's log:\n{worker.log_tail()}")
        time.sleep(2)  # one more refresh of the workers table
        pages = [shoot(base, "/", worker.nodename), shoot(base, "/tasks", "RunFailed"), broker]
    finally:
        worker.stop()
        flower.terminate()
        flower.wait(15)
        res.close()
        delete_prefix(ENV["MAILPIPE_BROKER_URL"], ENV["MAILPIPE_REDIS_PREFIX"])

    sheet = Image.new("RGB", (max(p.width for p in pages), sum(p.height for p in pages)), "white")
    top = 0
    for page in pages:
        sheet.paste(page, (0, top))
        top += page.height
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(args.out, optimize=True)
    shutil.rmtree(WORK, ignore_errors=True)
    print(f"wrote {args.out} ({sheet.width}x{sheet.height})")


if __name__ == "__main__":
    main()
