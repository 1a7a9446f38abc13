"""Inference servers that rlgate starts die with it, SIGKILL included (core.lifeline).

The server is a stand-in started through the real launcher (`inference.launch.start_server`,
and `rlgate inference serve` on top of it): a shell script given as the server's python. It
cannot import rlgate, like vLLM in its own venv, and forks a worker into its process group,
like vLLM's engine core. The test SIGKILLs the parent and waits for every one of them to go.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference.launch import ServerConfig, start_server, stop_server
from rlgate.stack import free_port
from tests.procs import alive

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 15.0

# Stands in for the server's python: records its pid and its worker's, then waits to be killed.
FAKE_SERVER = """#!/bin/sh
{trap}
sleep 300 &
echo "$$ $!" > {pids}.tmp && mv {pids}.tmp {pids}
exec sleep 301
"""

# A parent that starts the stand-in through the launcher, from its main thread or from a
# thread that ends at once (where PR_SET_PDEATHSIG cannot be used), and then just waits.
PARENT = """
import sys, threading, time
from pathlib import Path
from inference.launch import ServerConfig, start_server

model, python, grace, where = sys.argv[1:]
cfg = ServerConfig(
    kind="vllm", model_dir=Path(model), python=Path(python), stop_timeout_s=float(grace)
)
if where == "thread":
    starter = threading.Thread(target=start_server, args=(cfg,))
    starter.start()
    starter.join()
else:
    start_server(cfg)
print("started", flush=True)
time.sleep(600)
"""


def wait_gone(pids: list[int], deadline_s: float = DEADLINE_S) -> list[int]:
    """The pids still alive after `deadline_s` (empty when all went in time)."""
    deadline = time.monotonic() + deadline_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def watchers_of(pgid: int) -> list[int]:
    """Live `python -m core.lifeline FD PGID GRACE` processes for group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"core.lifeline" in argv and str(pgid).encode() in argv and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_watched(pgid: int, deadline_s: float = 30.0) -> list[int]:
    """`watchers_of(pgid)` once there is one (or after `deadline_s`). The watcher starts
    just after the server (`TetheredProcess`: until then the server's parent-death signal
    covers it), a Python start that a loaded machine may delay past the server's first
    write."""
    deadline = time.monotonic() + deadline_s
    while not (found := watchers_of(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def fake_server(tmp_path: Path, ignore_sigterm: bool = False) -> tuple[Path, Path]:
    """(the stand-in's path, the file where it writes "server_pid worker_pid")."""
    pids = tmp_path / "pids"
    script = tmp_path / "fake-python"
    trap = "trap '' TERM" if ignore_sigterm else ""
    script.write_text(FAKE_SERVER.format(trap=trap, pids=pids))
    script.chmod(0o755)
    return script, pids


def read_pids(path: Path, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, "the stand-in server never started"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_rlgate_inference_serve_killed_takes_its_server_along(tmp_path: Path) -> None:
    script, pid_file = fake_server(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlgate.cli", "inference", "serve", "--backend", "vllm",
         "--model", str(model), "--python", str(script), "--port", str(free_port()),
         "--log", str(tmp_path / "server.log")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids: list[int] = []
    try:
        pids = read_pids(pid_file)
        assert all(alive(p) for p in pids)
        assert wait_watched(pids[0]), "a watcher tethers the server's group to rlgate"
        serve.kill()
        serve.wait(10)
        assert wait_gone(pids) == [], "the server or its worker outlived `rlgate inference serve`"
        assert wait_gone(watchers_of(pids[0])) == []
    finally:
        serve.kill()
        serve.wait()
        kill_all(pids)


@pytest.mark.parametrize(
    ("where", "ignore_sigterm"),
    [("main", False), ("thread", False), ("main", True)],
    ids=["main-thread", "from-a-thread", "ignores-sigterm"],
)
def test_a_server_dies_with_its_parent(tmp_path: Path, where: str, ignore_sigterm: bool) -> None:
    script, pid_file = fake_server(tmp_path, ignore_sigterm)
    grace_s = 1.0
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), str(script), str(grace_s), where],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
        pids = read_pids(pid_file)
        time.sleep(0.5)  # the starting thread has ended: the server must not have followed it
        assert all(alive(p) for p in pids)
        parent.kill()
        parent.wait(10)
        assert wait_gone(pids) == [], f"outlived its parent: {pids}"
    finally:
        parent.kill()
        parent.wait()
        kill_all(pids)


def test_stopping_a_server_also_ends_its_watcher(tmp_path: Path) -> None:
    script, pid_file = fake_server(tmp_path)
    cfg = ServerConfig(kind="vllm", model_dir=tmp_path, python=script, stop_timeout_s=5)
    proc = start_server(cfg)
    pids: list[int] = []
    try:
        pids = read_pids(pid_file)
        assert len(wait_watched(proc.pid)) == 1
    finally:
        stop_server(proc)
        # The worker is in the server's group: stop_server's SIGTERM reaches it too.
        assert wait_gone(pids) == []
        assert wait_gone(watchers_of(proc.pid)) == []
        kill_all(pids)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_kernel_stops_the_server_even_without_its_watcher(tmp_path: Path) -> None:
    script, pid_file = fake_server(tmp_path)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), str(script), "1", "main"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "started"
        pids = read_pids(pid_file)
        kill_all(watchers_of(pids[0]))
        parent.kill()
        parent.wait(10)
        # PR_SET_PDEATHSIG reaches the server itself; its worker needed the watcher.
        assert wait_gone(pids[:1]) == []
    finally:
        parent.kill()
        parent.wait()
        kill_all(pids)
