"""Start a real Celery worker for train steps: `python -m trainer.worker` or `rlgate worker`."""

from __future__ import annotations

import logging

from rlgate.lifeline import die_with_parent
from rlgate.settings import Settings
from trainer.celery_app import make_celery
from trainer.tasks import register_tasks


def run_worker(settings: Settings, loglevel: str = "INFO") -> None:
    """Blocks. Solo pool: one step at a time, and torchrun children can be spawned from it."""
    die_with_parent()  # when started by `rlgate up` or the demo: stop with it
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = make_celery(settings.queue())
    register_tasks(app, settings)
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            f"--queues={settings.queue_name}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    run_worker(Settings())
