"""Run the gateway under uvicorn with Settings from the environment: one process, or N on a port."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket

import uvicorn
from fastapi import FastAPI

from core.lifeline import PARENT_ENV, die_with_parent
from core.settings import Settings
from core.store.migrate import upgrade
from gateway.app import create_app
from gateway.metrics import MULTIPROC_ENV
from rlgate.stack import settings_env

LOG_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per backend call otherwise


def serve(settings: Settings, host: str, port: int, workers: int = 1) -> None:
    """Blocks until uvicorn stops (SIGTERM or SIGINT: in-flight requests finish first).

    `workers > 1`: that many gateway processes share the port (uvicorn's
    supervisor, which restarts one that dies) and the store, which must be
    PostgreSQL; the migrations run once, here, before any of them starts. Each
    process dies with this one, however this one ends (`core.lifeline`).

    Raises ValueError, before anything listens, when the admin credential does not fit
    the bind (the development key off loopback), or `workers > 1` on SQLite.
    """
    settings.resolved_admin_key(host)
    die_with_parent()  # when started by the demo, a bench or a test: stop with it
    if workers <= 1:
        app = create_app(settings, tune_gc=True)
        uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
        return
    settings = settings.model_copy(update={"gateway_workers": workers})
    settings.check_workers()
    upgrade(settings.resolved_database_url)
    os.environ.update(settings_env(settings))  # each worker builds these Settings
    # Their /metrics counters add up through files in a folder of this supervisor's own (the
    # data dir may be shared by other hosts' gateways): files of another start would count.
    shared = (
        settings.data_dir.resolve() / "metrics-processes" / f"{socket.gethostname()}-{os.getpid()}"
    )
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    os.environ[MULTIPROC_ENV] = str(shared)
    os.environ[PARENT_ENV] = str(os.getpid())  # ... and dies with this supervisor
    try:
        uvicorn.run(
            "rlgate.serve:app_from_env",
            factory=True,
            workers=workers,
            host=host,
            port=port,
            log_level="info",
            access_log=False,
        )
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def app_from_env() -> FastAPI:
    """uvicorn's factory in each gateway process of `serve(workers=N)`."""
    configure_logging()
    die_with_parent()
    return create_app(Settings(), migrate=False, tune_gc=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="rlgate gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=None, help="default: gateway_workers")
    args = parser.parse_args()
    configure_logging()
    settings = Settings()
    try:
        serve(settings, args.host, args.port, args.workers or settings.gateway_workers)
    except ValueError as exc:
        raise SystemExit(f"rlgate gateway: {exc}") from None


if __name__ == "__main__":
    main()
