"""Apply or revert the Alembic migrations programmatically (no alembic.ini needed)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations
from gateway.store.db import normalize_url


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # ConfigParser interpolates '%': escape it (percent-encoded passwords).
    cfg.set_main_option("sqlalchemy.url", normalize_url(url, asynchronous=False).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
