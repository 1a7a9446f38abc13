"""A worker on node R > 0 of a multi-node group: it takes no tasks, it only lends its ranks.

    rlgate worker --nnodes 2 --node-rank 1 --rdzv-endpoint NODE0:29400 --nproc-per-node 8

Node 0's worker forms a group when a step needs one; torchrun's c10d
rendezvous then waits (up to `join_timeout_s`) for every node. So this node
runs torchrun in a loop: each round joins the next rendezvous, its ranks
read the run's `Init` from the rendezvous store and follow the leader's
commands (`trainer.resident_rank`), and the round ends when the group is
released, fails, or no group formed within the join timeout. SIGTERM (or
the parent's death, `die_with_parent`) stops the current round's ranks and
the loop.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time
from pathlib import Path

from core.config import NodeSpec
from trainer.resident import start_ranks
from trainer.torchrun import kill_group

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # between rounds: a released group's rendezvous port takes a moment to free


def join_forever(
    node: NodeSpec, local_ranks: int, threads_per_rank: int, stop: threading.Event | None = None
) -> None:
    """Join group after group until `stop` is set (or SIGTERM, when run in the main thread)."""
    if node.node_rank == 0:
        raise ValueError("node 0 takes the Celery tasks: run `rlgate worker` there, not a joiner")
    stop = stop or threading.Event()
    current = None

    def on_term(signum: int, _frame: object) -> None:
        stop.set()
        if current is not None and current.poll() is None:
            kill_group(current)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
    with tempfile.TemporaryDirectory(prefix="rlgate-join-") as tmp:
        rounds = 0
        while not stop.is_set():
            rounds += 1
            work = Path(tmp) / f"round-{rounds}"
            work.mkdir()
            logger.info(
                "node %d of %d: joining %s with %d ranks",
                node.node_rank,
                node.nnodes,
                node.rdzv_endpoint,
                local_ranks,
            )
            current = start_ranks(node, local_ranks, work, threads_per_rank, {})
            while current.poll() is None and not stop.is_set():
                time.sleep(0.2)
            if current.poll() is None:
                kill_group(current)
            code = current.wait()
            logger.info("node %d: round %d ended (torchrun exit %d)", node.node_rank, rounds, code)
            stop.wait(RETRY_S)
