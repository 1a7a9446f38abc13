"""The one settings object for a gateway or a worker, read from RLGATE_* variables once."""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer.config import QueueConfig

logger = logging.getLogger(__name__)

DEV_ADMIN_KEY = "rlgate-dev-admin-key"


class Settings(BaseSettings):
    """Built by the CLI or a test and passed down; nothing deeper reads the environment."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", extra="ignore")

    data_dir: Path = Field(Path("rlgate-data"), description="SQLite file, broker, checkpoints")
    database_url: str = Field("", description="empty: SQLite file in data_dir")
    broker_url: str = Field("", description="empty: embedded filesystem broker; or redis://")
    result_backend: str = Field("", description="empty: same Redis as the broker, or files")
    queue_name: str = "train"
    admin_key: str = Field("", description="admin credential; empty only in dev_mode")
    dev_mode: bool = Field(True, description="allow the development admin key")
    public_url: str = Field("", description="base URL handed to agents; empty: request's")
    model_cache_dir: Path | None = Field(None, description="default: data_dir")
    max_body_bytes: int = Field(4 * 1024 * 1024, description="larger request bodies get 413")
    max_batch_size: int = Field(32, ge=1, description="local backend batch size")
    sync_interval_s: float = Field(0.5, gt=0, description="how often to look for new versions")
    step_timeout_s: float = Field(
        1800.0, gt=0, description="resend a train step queued or running longer than this"
    )

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'rlgate.db').resolve()}"

    @property
    def models_dir(self) -> Path:
        return self.model_cache_dir or self.data_dir

    @property
    def checkpoints_dir(self) -> Path:
        return self.data_dir.resolve() / "checkpoints"

    def resolved_admin_key(self) -> str:
        if self.admin_key:
            return self.admin_key
        if not self.dev_mode:
            raise ValueError("RLGATE_ADMIN_KEY is empty: set it, or set RLGATE_DEV_MODE=1")
        logger.warning("no RLGATE_ADMIN_KEY set: using the development key %r", DEV_ADMIN_KEY)
        return DEV_ADMIN_KEY

    def queue(self) -> QueueConfig:
        return QueueConfig(
            broker_url=self.broker_url,
            result_backend=self.result_backend,
            data_dir=self.data_dir,
            queue_name=self.queue_name,
        )
