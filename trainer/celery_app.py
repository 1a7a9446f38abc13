"""Build the Celery app from a QueueConfig; nothing is created at import time.

Embedded default: kombu's filesystem transport. It needs no server, survives
restarts (messages are files under the data directory) and still runs the
real task code in a real `celery worker` process. Production: Redis as broker
and result backend, with a visibility timeout past the step timeout
(`QueueConfig.visibility_timeout_s`).
"""

from __future__ import annotations

from celery import Celery

from core.config import QueueConfig

TRAIN_STEP_TASK = "rlgate.train_step"


def make_celery(cfg: QueueConfig) -> Celery:
    app = Celery("rlgate", broker=cfg.resolved_broker(), backend=cfg.resolved_backend())
    conf = {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": cfg.queue_name,
        "task_routes": {TRAIN_STEP_TASK: {"queue": cfg.queue_name}},
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if cfg.resolved_broker().startswith(("redis", "rediss")):
        conf["broker_transport_options"] = {"visibility_timeout": cfg.visibility_timeout_s()}
    if cfg.resolved_broker().startswith("filesystem"):
        folder = cfg.data_dir.resolve() / "celery-broker"
        (folder / "processed").mkdir(parents=True, exist_ok=True)
        (cfg.data_dir.resolve() / "celery-results").mkdir(parents=True, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "processed_folder": str(folder / "processed"),
            "store_processed": False,
            # kombu's default is ./control in the working directory
            "control_folder": str(folder / "control"),
            # kombu polls the folder once a second by default: a step then waits up to a
            # second to start, and a warm shutdown several. A listing of a folder of a few
            # files every 0.1 s costs nothing measurable.
            "polling_interval": 0.1,
        }
    app.conf.update(conf)
    return app
