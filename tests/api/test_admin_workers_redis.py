"""Workers and queue status on a Redis broker: queue depth counts waiting train steps.

No worker consumes the test's own queue, so the messages it sends stay there;
the queue name is unique per test and deleted afterwards.
"""

from __future__ import annotations

import uuid

import pytest
import redis
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.config import QueueConfig
from core.store.db import make_async_engine
from core.store.migrate import upgrade
from gateway.admin.workers import WorkerAdmin
from trainer.celery_app import make_celery
from trainer.submit import submit_train_step

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/0"


async def test_queue_depth_and_unreachable_broker(tmp_path) -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis must run on 127.0.0.1:6379: {exc}")
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    queue = f"rlgate-test-{uuid.uuid4().hex[:10]}"
    celery = make_celery(QueueConfig(broker_url=REDIS_URL, data_dir=tmp_path, queue_name=queue))
    try:
        admin = WorkerAdmin(sessions, celery, queue, timeout_s=0.5)
        empty = await admin.status()
        assert empty.reachable and empty.broker == "redis"
        assert empty.queue_depth in (None, 0)  # None: nothing declared the queue yet
        for step in range(3):
            submit_train_step(celery, "run_x", step)
        full = await admin.status()
        assert full.queue_depth == 3 and full.pending_steps == 0
        # a broker that is down: an answer (reachable false), not an error
        down = make_celery(
            QueueConfig(broker_url="redis://127.0.0.1:1/0", data_dir=tmp_path, queue_name=queue)
        )
        down.conf.broker_connection_timeout = 0.5
        down.conf.broker_connection_max_retries = 0
        status = await WorkerAdmin(sessions, down, queue, timeout_s=0.5).status()
        assert status.reachable is False and status.error
    finally:
        redis.Redis.from_url(REDIS_URL).delete(queue)
        await engine.dispose()
