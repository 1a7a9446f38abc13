"""The app factory: settings in, a FastAPI app out; engines and services built in lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import install_error_handlers
from gateway.middleware import BodyLimit
from gateway.routes import (
    admin,
    completions_legacy,
    export,
    health,
    openai_api,
    responses,
    rewards,
)
from gateway.services.backends import BackendPool
from gateway.services.completions import ChatService
from gateway.services.keys import KeyService
from gateway.services.rewards import RewardService
from gateway.services.runs import RunService
from gateway.services.training import TrainingScheduler, WeightSync
from gateway.store.db import make_async_engine
from gateway.store.migrate import upgrade
from rlgate.settings import Settings
from trainer.celery_app import make_celery

logger = logging.getLogger(__name__)

EPISODE_PREFIXES = ("", "/episodes/{episode_id}", "/groups/{group_id}/episodes/{episode_id}")


def create_app(settings: Settings, *, migrate: bool = True) -> FastAPI:
    """Build the gateway. `migrate` applies Alembic migrations at start (embedded default)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        url = settings.resolved_database_url
        if migrate:
            await asyncio.to_thread(upgrade, url)
        engine = make_async_engine(url)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        pool = BackendPool(max_batch_size=settings.max_batch_size)
        celery = make_celery(settings.queue())
        scheduler = TrainingScheduler(sessions, celery, settings.step_timeout_s)
        sync = WeightSync(sessions, pool, scheduler, settings.sync_interval_s)
        app.state.settings = settings
        app.state.admin_key = settings.resolved_admin_key()
        app.state.sessions = sessions
        app.state.pool = pool
        app.state.chat = ChatService(sessions, pool)
        app.state.rewards = RewardService(sessions)
        app.state.runs = RunService(sessions, pool, settings.models_dir)
        app.state.keys = KeyService(sessions)
        app.state.scheduler = scheduler
        app.state.weight_sync = sync
        sync_task = asyncio.create_task(sync.run_forever(), name="weight-sync")
        try:
            yield
        finally:
            sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sync_task
            await pool.close()
            await engine.dispose()

    app = FastAPI(title="rlgate", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(export.router)
    for prefix in EPISODE_PREFIXES:
        app.include_router(openai_api.router, prefix=prefix, include_in_schema=prefix == "")
        app.include_router(completions_legacy.router, prefix=prefix, include_in_schema=prefix == "")
        app.include_router(responses.router, prefix=prefix, include_in_schema=prefix == "")
        app.include_router(rewards.router, prefix=prefix, include_in_schema=prefix == "")

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"service": "rlgate", "docs": "/docs", "health": "/health"})

    return app
