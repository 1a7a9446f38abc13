"""The task-submission API: the only part of the trainer the gateway imports."""

from __future__ import annotations

from celery import Celery

from trainer.celery_app import TRAIN_STEP_TASK


def submit_train_step(app: Celery, run_id: str, step: int) -> str:
    """Enqueue training step `step` of `run_id`; the task id is deterministic per (run, step).

    Blocking (broker I/O): call it off the event loop.
    """
    task_id = f"{run_id}-step-{step}"
    app.send_task(TRAIN_STEP_TASK, args=[run_id, step], task_id=task_id)
    return task_id
