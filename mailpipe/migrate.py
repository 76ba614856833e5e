"""`mailpipe db upgrade`: Alembic migrations, run once before a rollout (the release role)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from mailpipe.db import normalise_url

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would eat a literal % in a password.
    config.set_main_option("sqlalchemy.url", normalise_url(database_url).replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)
