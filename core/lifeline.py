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

A program that cannot import rlgate (an inference server in a virtualenv of
its own, any binary) gets the same lifeline from outside, through
`TetheredProcess`. It starts the program in a session of its own and ties the
whole process group (the server and the workers it forks) to this process
in two ways:

1. On Linux, when started from the main thread, the kernel sends the program
   SIGTERM when this process dies (PR_SET_PDEATHSIG, set through ctypes
   between fork and exec). From another thread it would fire when that
   thread ends, so it is not set there.
2. Always, a watcher process (`python -m core.lifeline`, on rlgate's own
   interpreter) holds the read end of a pipe whose write end only this
   process has. The kernel closes that end when this process dies, however it
   dies; the watcher then sends SIGTERM to the group and SIGKILL to whatever
   is left after `grace_s`. It leaves by itself once the group is gone, and
   `TetheredProcess.wait()` cuts the pipe once the program has exited, so the
   watcher also stops any worker the program left behind. A child that this
   process forks without exec inherits the write end and keeps the tether
   alive while it lives.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

PARENT_ENV = "RLGATE_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
        # The kernel ends the process `grace_s` from now whatever state Python is in
        # (SIGALRM's default action; nothing in rlgate handles it): a graceful shutdown
        # that waits on a held request or a stuck thread cannot keep it alive.
        signal.alarm(max(1, math.ceil(grace_s)))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("shutdown took longer than %.0f s after the parent died: exiting", grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


# --- programs that cannot import rlgate -----------------------------------------------------


def pdeathsig_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` after which the kernel sends the child `sig` when this process dies;
    None off Linux and off the main thread, where that would not mean "this process"."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec


class TetheredProcess(subprocess.Popen):
    """`subprocess.Popen` in a session of its own whose process group stops when this process
    dies: SIGTERM, then SIGKILL after `grace_s` (see the module docstring)."""

    def __init__(self, args: Sequence[str], *, grace_s: float = 20.0, **kwargs: Any) -> None:
        super().__init__(args, start_new_session=True, preexec_fn=pdeathsig_preexec(), **kwargs)
        try:
            self._tether: int | None = start_watcher(self.pid, grace_s, log=kwargs.get("stdout"))
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            super().wait()
            raise

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        self.cut_tether()
        return code

    def cut_tether(self) -> None:
        """Let the watcher go: it stops whatever is left of the group, then exits."""
        fd, self._tether = self._tether, None
        if fd is not None:
            os.close(fd)


def start_watcher(pgid: int, grace_s: float, log: Any = None) -> int:
    """Start the watcher of process group `pgid`; returns the pipe end that keeps it waiting.

    `log`, a file object, gets the watcher's messages (else they are dropped: a watcher
    holding this process's stdout open would keep a reader of it from seeing its end).
    """
    read_fd, write_fd = os.pipe()
    out = log if hasattr(log, "fileno") else subprocess.DEVNULL
    try:
        cmd = [sys.executable, "-m", "core.lifeline", str(read_fd), str(pgid), str(grace_s)]
        subprocess.run(
            cmd,
            pass_fds=(read_fd,),
            start_new_session=True,  # Ctrl-C in a terminal must not reach it
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            check=True,
            timeout=120,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return write_fd


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(pgid: int, grace_s: float, poll_s: float = 0.1) -> None:
    """SIGTERM to process group `pgid`, SIGKILL to whatever of it is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def watch(fd: int, pgid: int, grace_s: float, poll_s: float = 0.5) -> None:
    """Until group `pgid` is gone; if `fd` reaches its end first, stop the group."""
    while group_alive(pgid):
        ready, _, _ = select.select([fd], [], [], poll_s)
        if ready and not os.read(fd, 1):
            print(f"core.lifeline: the parent of group {pgid} is gone", file=sys.stderr)
            sys.stderr.flush()
            stop_group(pgid, grace_s)
            return


def main(argv: list[str]) -> None:
    """`python -m core.lifeline FD PGID GRACE_S`: fork, and watch in the grandchild."""
    fd, pgid, grace_s = int(argv[0]), int(argv[1]), float(argv[2])
    if os.fork():  # the starter waits for this process; the grandchild is re-parented
        os._exit(0)  # so that nobody has to reap the watcher
    watch(fd, pgid, grace_s)


if __name__ == "__main__":
    main(sys.argv[1:])
