"""The app factory: settings in, a FastAPI app out; engines and services built in lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from starlette.datastructures import State

from core.settings import Settings
from core.store.db import is_postgres, make_async_engine
from core.store.migrate import upgrade
from gateway.admin.key_quotas import KeyQuotaAdmin
from gateway.admin.keys import KeyService
from gateway.admin.runs import RunService
from gateway.admin.state import close_admin_services, install_admin_services
from gateway.agent.capture import CaptureWriter
from gateway.agent.completions import ChatService
from gateway.agent.episodes import EVAL_PREFIX
from gateway.agent.policies import PolicyRuns
from gateway.agent.rewards import RewardService
from gateway.agent.run_status import RunStatusService
from gateway.control.admission import Admission
from gateway.control.backends import BackendPool
from gateway.control.leader import AdvisoryLockLeader, LeaderCollector, SoleLeader, make_leader
from gateway.control.multiprocess import RemoteOnlyPool, RemoteOnlyRuns
from gateway.control.run_replicas import ReplicaService
from gateway.control.scheduler import TrainingScheduler
from gateway.control.swap_barrier import make_server_swaps
from gateway.control.swapper import SwapLoop
from gateway.control.table_stats import TableStats
from gateway.dashboard.routes import install_dashboard
from gateway.errors import install_error_handlers
from gateway.gc_tuning import tune_for_serving
from gateway.metrics import GatewayMetrics, PrometheusMiddleware, multiprocess_dir
from gateway.metrics import router as prometheus_router
from gateway.middleware.auth_cache import InvalidateOnAdminWrite, RunKeyCache
from gateway.middleware.body_limit import BodyLimit
from gateway.middleware.identity import AgentKeyCheck, IdentityMiddleware
from gateway.middleware.overload import OverloadCollector, OverloadGuard, OverloadMiddleware
from gateway.middleware.quotas import QuotaMiddleware
from gateway.openapi_errors import install_error_responses
from gateway.routes import (
    chat,
    completions,
    episodes,
    evals,
    export,
    health,
    keys,
    messages,
    metrics,
    models,
    quotas,
    replicas,
    responses,
    rewards,
    run_status,
    runs,
)
from trainer.submit import make_celery

logger = logging.getLogger(__name__)

PREPARE_AT_START_S = 15.0  # the most a starting process waits for its runs to be prepared

_EPISODE_FORMS = ("", "/episodes/{episode_id}", "/groups/{group_id}/episodes/{episode_id}")
# Each form again under /eval: held-out calls, served and scored, never trained (gateway.deps).
EPISODE_PREFIXES = (*_EPISODE_FORMS, *(EVAL_PREFIX + form for form in _EPISODE_FORMS))
# Mounted under each of EPISODE_PREFIXES, first in the route table (hottest first).
AGENT_ROUTERS = (chat, completions, messages, responses, rewards, models, run_status)
# Keys and replicas before runs: its catch-all POST /runs/{id}/{action} would take theirs.
ADMIN_ROUTERS = (replicas, keys, runs, export, episodes, evals, metrics, quotas)


@dataclass
class Engines:
    """What the lifespan opened and must close, in `close`'s order."""

    engine: AsyncEngine
    call_engine: AsyncEngine | None
    capture: CaptureWriter
    pool: BackendPool
    leader: SoleLeader | AdvisoryLockLeader

    async def close(self, state: State) -> None:
        await self.leader.close()  # another process may lead at once
        await self.capture.close()  # answered completions are committed before the engine goes
        if self.call_engine is not None:
            await self.call_engine.dispose()
        await close_admin_services(state)
        await self.pool.close()  # and the swaps it joined (the barrier's connections)
        await self.engine.dispose()


def create_app(settings: Settings, *, migrate: bool = True, tune_gc: bool = False) -> FastAPI:
    """Build the gateway. `migrate` applies Alembic migrations at start (embedded default);
    `tune_gc`: a server process's garbage-collector settings (`gateway.gc_tuning`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engines = await build_services(app.state, settings, migrate)
        tasks = await start_tasks(app.state, engines, tune_gc)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await engines.close(app.state)

    # FastAPI's own OpenTelemetry hooks are off: rlgate exports Prometheus metrics itself, and
    # the check for a configured tracer costs an environment read on every request.
    app = FastAPI(
        title="rlgate",
        version="0.1.0",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    install_error_handlers(app)
    install_middleware(app, settings)
    install_routes(app)
    return app


def install_middleware(app: FastAPI, settings: Settings) -> None:
    """The middleware stack, outermost last. A request meets: metrics, its identity
    (conflicting keys: 401), a sampling call's key checked (401 before any slot or body
    read), quotas (valid keys only), an overload slot, the body's size cap and read
    deadline, cache invalidation."""
    app.state.run_keys = RunKeyCache(
        settings.auth_cache_ttl_s, max_lookups=settings.auth_max_lookups
    )
    app.add_middleware(InvalidateOnAdminWrite, cache=app.state.run_keys)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, read_timeout_s=settings.body_read_timeout_s
    )
    # Sheds sampling calls past capacity before any of their work but the key check.
    app.state.overload = OverloadGuard(settings.overload())
    app.add_middleware(OverloadMiddleware, guard=app.state.overload)
    app.add_middleware(QuotaMiddleware)  # per-key limits, when quotas are on
    app.add_middleware(AgentKeyCheck)
    app.add_middleware(IdentityMiddleware)
    app.state.metrics = GatewayMetrics(multiprocess_dir())  # this app's own registry
    app.add_middleware(PrometheusMiddleware, metrics=app.state.metrics)
    app.state.metrics.registry.register(OverloadCollector(app.state.overload))


def install_routes(app: FastAPI) -> None:
    """Agent routes first: every agent call walks the route table until its route matches,
    and no admin, dashboard or health path matches an agent route (tests/api/test_routes.py)."""
    for prefix in EPISODE_PREFIXES:
        for agent in AGENT_ROUTERS:
            app.include_router(agent.router, prefix=prefix, include_in_schema=prefix == "")
    app.include_router(health.router)
    for admin in ADMIN_ROUTERS:
        app.include_router(admin.router)
    app.include_router(prometheus_router)
    install_dashboard(app)
    install_error_responses(app)

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"service": "rlgate", "docs": "/docs", "health": "/health"})


async def build_services(state: State, settings: Settings, migrate: bool) -> Engines:
    """Engines, the backend pool (its swaps chosen here, once), the control plane and the
    services on `state`; nothing started yet but the capture writer."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    if migrate:
        await asyncio.to_thread(upgrade, url)
    engine = make_async_engine(url, settings.db_pool_size)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    shared = settings.gateway_workers > 1  # other processes serve this store too
    pool = (RemoteOnlyPool if shared else BackendPool)(
        max_batch_size=settings.max_batch_size,
        sessions=sessions,
        replica_config=settings.replica_config(),
        threads=settings.threads().backend,
        credentials=settings.server_credentials(),
        eval_pinned_copies=settings.eval_pinned_copies,
        kv_cache_mb=settings.kv_cache_mb,
        prefix_cache_mb=settings.prefix_cache_mb,
        swaps=make_server_swaps(url, settings.replica_config().load_retry_s),
    )
    celery = make_celery(settings.queue())
    leader = make_leader(url, settings.leader_interval_s)
    state.settings = settings
    state.admin_key = settings.resolved_admin_key()
    state.sessions = sessions
    state.pool = pool
    state.scheduler = TrainingScheduler(
        sessions, celery, settings.step_timeout_s, settings.full_scan_s, leader
    )
    state.swap_loop = SwapLoop(sessions, pool, settings.sync_interval_s)
    state.leader = leader
    state.metrics.registry.register(LeaderCollector(leader))
    # On PostgreSQL the statements every agent call runs (its placement reads and the
    # group commit) have a pool of their own, in autocommit, run straight on psycopg
    # (`core.store.pg_driver`). The group commit's commits do not wait for the WAL
    # flush unless `capture_synchronous_commit` (the flush was most of the latency
    # rlgate added to a call: docs/deployment.md, "Durability of captures").
    call_engine: AsyncEngine | None = None
    call_sessions = sessions
    if is_postgres(url):
        call_engine = make_async_engine(
            url,
            settings.db_call_pool_size,
            autocommit=True,
            synchronous_commit=settings.capture_synchronous_commit,
        )
        call_sessions = async_sessionmaker(call_engine, expire_on_commit=False)
    capture = CaptureWriter(
        call_sessions, max_batch=settings.capture_max_batch, linger_s=settings.capture_linger_s
    )
    capture.on_commit = state.metrics.committed  # counted once in the store
    capture.start()
    state.capture = capture
    admission = Admission(sessions, pool.serving_version)
    state.policies = PolicyRuns(sessions, settings.auth_cache_ttl_s)
    state.run_keys.listeners.append(state.policies.invalidate)  # admin writes reach both
    state.chat = ChatService(
        sessions, pool, capture, admission, reads=call_sessions, policies=state.policies
    )
    state.run_status = RunStatusService(sessions, admission)
    state.rewards = RewardService(sessions, state.policies)
    state.runs = (RemoteOnlyRuns if shared else RunService)(
        sessions, pool, settings.models_dir, local_trainer=not settings.broker_url
    )
    state.replicas = ReplicaService(sessions, pool)
    install_admin_services(state, settings, sessions, pool, celery)
    state.keys = KeyService(sessions, state.quotas)  # rotation keeps key limits
    state.key_quotas = KeyQuotaAdmin(state.quotas, sessions)
    state.table_stats = TableStats(engine)
    return Engines(engine, call_engine, capture, pool, leader)


async def start_tasks(state: State, engines: Engines, tune_gc: bool) -> list[asyncio.Task]:
    """The background tasks, started once this process leads if alone on its store and its
    active runs are prepared (or `PREPARE_AT_START_S` passed); the order to cancel them."""
    leader = engines.leader
    await leader.step()  # alone on its store, a process leads from its first request
    leader_task = asyncio.create_task(leader.run_forever(), name="leader")
    swap_task = asyncio.create_task(state.swap_loop.run_forever(), name="swap-loop")
    interval_s = state.settings.sync_interval_s
    schedule_task = asyncio.create_task(state.scheduler.run_forever(interval_s), name="scheduler")
    prepared = asyncio.Event()
    prewarm_task = asyncio.create_task(prewarm(state.chat, tune_gc, prepared), name="prewarm")
    # Serve once the active runs are prepared, so that no first call waits for a load;
    # a store of many runs (or servers slow to answer) finishes in the background.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(prepared.wait(), PREPARE_AT_START_S)
    stats_task = asyncio.create_task(
        state.table_stats.run_forever(lambda: leader.is_leader), name="table-stats"
    )
    if tune_gc and not prepared.is_set():  # else the prewarm froze the heap already
        tune_for_serving()
    adaptive = state.overload.adaptive
    lag_task = asyncio.create_task(
        adaptive.run_forever() if adaptive else asyncio.Event().wait(), name="overload-limit"
    )
    return [prewarm_task, stats_task, swap_task, schedule_task, lag_task, leader_task]


async def prewarm(
    chat: ChatService, tune_gc: bool, prepared: asyncio.Event, interval_s: float = 2.0
) -> None:
    """The runs' serving prepared (`ChatService.prewarm`), then what it loaded frozen too
    (`prepared` set); then, every `interval_s`, the runs created or resumed since."""
    try:
        await chat.prewarm()
    except Exception:  # the database away at start: the loop below tries again
        logger.exception("preparing the runs at start failed")
    if tune_gc:
        tune_for_serving()
    prepared.set()
    while True:
        await asyncio.sleep(interval_s)
        try:
            await chat.prewarm()
        except Exception:  # the database away: the next pass tries again
            logger.exception("preparing new runs failed")
