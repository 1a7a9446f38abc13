"""Build the admin and dashboard services onto `app.state` (called from the app's lifespan)."""

from __future__ import annotations

from typing import Any

from celery import Celery
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.settings import Settings
from gateway.admin.episodes import EpisodeAdmin
from gateway.admin.evals import EvalAdmin
from gateway.admin.metrics import MetricsAdmin
from gateway.admin.run_ops import RunAdmin
from gateway.admin.workers import WorkerAdmin
from gateway.control.backends import BackendPool
from gateway.dashboard.auth import SessionSigner
from gateway.middleware.quotas import Limits, QuotaService


def install_admin_services(
    state: Any,
    settings: Settings,
    sessions: async_sessionmaker[AsyncSession],
    pool: BackendPool,
    celery: Celery,
) -> None:
    """Needs `state.admin_key` set: dashboard sessions are signed under it."""
    state.run_admin = RunAdmin(sessions, pool, settings.checkpoints_dir)
    state.episode_admin = EpisodeAdmin(sessions)
    state.metrics_admin = MetricsAdmin(sessions)
    state.eval_admin = EvalAdmin(sessions)
    state.worker_admin = WorkerAdmin(
        sessions, celery, settings.queue_name, pool=pool, threads=settings.threads()
    )
    state.dashboard_signer = SessionSigner(state.admin_key)
    state.quotas = (
        QuotaService.from_url(
            settings.quota_redis_url,
            settings.quota_prefix,
            Limits(settings.quota_requests_per_min, settings.quota_tokens_per_day),
        )
        if settings.quota_redis_url
        else None
    )


async def close_admin_services(state: Any) -> None:
    if getattr(state, "quotas", None) is not None:
        await state.quotas.close()
