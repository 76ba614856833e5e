"""Where the tests find the repository and the shared corpus of real emails and documents."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO.parent / "shared" / "corpus"
