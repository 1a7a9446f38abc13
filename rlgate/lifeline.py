"""Child processes that die with their parent, however the parent goes (SIGTERM, SIGINT, SIGKILL).

rlgate starts its gateway and worker as child processes (`rlgate.stack`).
A parent that exits through its `finally` stops them itself; one killed
with SIGKILL, or by a signal whose default action skips `finally`, cannot.
So each child also watches its parent: the parent names itself in
`PARENT_ENV` when it starts the child, and the child, on start, runs
`die_with_parent()`, a daemon thread that polls `os.getppid()`. When the
parent is gone (the child was re-parented), the child sends itself SIGTERM,
so it shuts down the way it would under a supervisor (uvicorn finishes
in-flight requests, Celery finishes or abandons its task), and exits hard
after `grace_s` if that shutdown hangs.

Polling rather than Linux's PR_SET_PDEATHSIG: the latter fires when the
*thread* that forked the child exits, which would kill children started
from a worker thread, and it exists on Linux only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

PARENT_ENV = "RLGATE_PARENT_PID"


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that must die with this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_parent(poll_s: float = 0.5, grace_s: float = 20.0) -> threading.Thread | None:
    """Start the parent watch if this process was started with `child_env`; else None."""
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return None
    parent = int(raw)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.warning("parent process %d is gone: shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("shutdown took longer than %.0f s after the parent died: exiting", grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
