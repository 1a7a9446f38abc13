"""`rlgate.stack.stop`: the embedded stack's processes shut down side by side."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rlgate.stack import stop

# Writes "term <t>" when SIGTERM arrives, lingers, then writes "exit <t>" and exits.
CHILD = """
import signal, sys, time
out = open(sys.argv[1], "a", buffering=1)
def on_term(*_):
    out.write(f"term {time.time()}\\n")
    time.sleep(float(sys.argv[2]))
    out.write(f"exit {time.time()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
out.write("ready\\n")
while True:
    time.sleep(0.05)
"""


def _start(log: Path, linger_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(log), str(linger_s)])
    while "ready" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.02)
    return proc


def _times(log: Path) -> dict[str, float]:
    lines = log.read_text().splitlines()[1:]
    return {k: float(v) for k, v in (line.split() for line in lines)}


def test_every_process_gets_sigterm_before_any_is_waited_for(tmp_path: Path) -> None:
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    a, b = _start(first, 0.5), _start(second, 0.0)
    stop(a, b)
    assert a.returncode == 0 and b.returncode == 0
    # the second heard SIGTERM while the first was still lingering, not after it exited
    assert _times(second)["term"] < _times(first)["exit"]


def test_a_process_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    proc = _start(log, 30.0)
    stop(proc, timeout_s=0.5)
    assert proc.returncode == -9
    assert "exit" not in log.read_text()


def test_an_exited_process_is_left_alone(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    stop(done)
    assert done.returncode == 0
