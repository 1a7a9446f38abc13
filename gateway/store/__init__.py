"""The store layer: SQLAlchemy models and data access, importable without the web app."""

from gateway.store import responses as _responses  # noqa: F401 - registers its table
from gateway.store.db import make_async_engine, make_sync_engine, normalize_url
from gateway.store.models import (
    ApiKey,
    Base,
    Completion,
    Episode,
    PolicyVersion,
    Reward,
    Run,
    TrainStep,
)

__all__ = [
    "ApiKey",
    "Base",
    "Completion",
    "Episode",
    "PolicyVersion",
    "Reward",
    "Run",
    "TrainStep",
    "make_async_engine",
    "make_sync_engine",
    "normalize_url",
]
