"""Start a real Celery worker for train steps: `python -m trainer.worker` or `rlgate worker`."""

from __future__ import annotations

import contextlib
import logging

import torch

from core.lifeline import die_with_parent
from core.settings import Settings
from trainer.celery_app import make_celery
from trainer.tasks import register_tasks

logger = logging.getLogger(__name__)


def apply_threads(settings: Settings) -> int:
    """Give this process the trainer's torch thread budget; returns the intra-op count.

    Called before any tensor work: the solo pool runs every step in this (main)
    thread, and the inter-op pool can only be sized before its first use.
    """
    budget = settings.threads()
    torch.set_num_threads(budget.trainer)
    # steps run ops one after another; a process that already used the pool keeps its size
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    logger.info(
        "trainer on %d torch threads (%d cores: backend %d, trainer %d)",
        torch.get_num_threads(),
        budget.cores,
        budget.backend,
        budget.trainer,
    )
    return torch.get_num_threads()


def preload_model_code() -> None:
    """Import Hugging Face's model code now, before the first task, rather than inside the
    first train step, which it made about 1.5 s longer on a 2-core machine."""
    import transformers.modeling_utils  # noqa: F401


def run_worker(settings: Settings, loglevel: str = "INFO") -> None:
    """Blocks. Solo pool: one step at a time, and torchrun children can be spawned from it.

    On node R > 0 of a multi-node group (`settings.node_rank`) it takes no tasks and only
    lends its ranks to the groups node 0 forms (`trainer.resident_join`).
    """
    die_with_parent()  # when started by `rlgate up` or the demo: stop with it
    if settings.node_rank > 0:
        from trainer.resident_join import join_forever

        budget = settings.threads().trainer
        join_forever(settings.node(), settings.nproc_per_node, budget // settings.nproc_per_node)
        return
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    apply_threads(settings)
    preload_model_code()
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
