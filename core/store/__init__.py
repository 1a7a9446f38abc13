"""The store layer: SQLAlchemy models and data access, importable without the web app.

Data access is one module per aggregate (`runs`, `episodes`, `completions`,
`rewards`, `steps`, `keys`, `replicas`): plain functions over the caller's
session that never commit, so the caller keeps its transaction and locks.
Async functions serve the gateway; the trainer's few are sync, named `*_sync`.
Services, the trainer and the benches write no SQL of their own.
"""

from core.store import responses as _responses  # noqa: F401 - registers its table
from core.store import sessions as _sessions  # noqa: F401 - registers its table
from core.store.db import make_async_engine, make_sync_engine, normalize_url
from core.store.models import (
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
