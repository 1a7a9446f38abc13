"""Start the embedded stack's processes: the gateway (uvicorn) and a Celery worker."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from core.lifeline import child_env
from core.settings import Settings
from inference.launch import wait_ready


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now on `host` (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def with_secrets(settings: Settings) -> Settings:
    """`settings` with a fresh `weight_sync_secret` unless one is set.

    The embedded stack's processes (gateway, worker, the worker's torchrun ranks) get
    it through their environment (`settings_env`), so the trainer's weight server is
    never open to another local user's process, even on loopback.
    """
    if settings.weight_sync_secret:
        return settings
    return settings.model_copy(update={"weight_sync_secret": secrets.token_urlsafe(32)})


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process build the same Settings."""
    env = dict(os.environ)
    # Model loading and saving progress bars would fill the logs on every train step.
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name, value in settings.model_dump().items():
        key = "RLGATE_" + name.upper()
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def _start(module: str, args: list[str], settings: Settings, log: Path | None) -> subprocess.Popen:
    """`python -m module args` with `settings` in its environment, output appended to `log`."""
    out = open(log, "ab") if log else None  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=child_env(settings_env(settings)),  # it dies with us, even on SIGKILL
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
    )


def start_worker(settings: Settings, log: Path | None = None) -> subprocess.Popen:
    return _start("trainer.worker", [], settings, log)


def start_gateway(
    settings: Settings, host: str, port: int, log: Path | None = None
) -> subprocess.Popen:
    return _start("rlgate.serve", ["--host", host, "--port", str(port)], settings, log)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 120) -> None:
    """Until the gateway at `url` answers `GET /health` with 200; raises if `proc` exits first."""
    # The gateway starts in seconds, so poll it more often than an inference server.
    wait_ready(url, proc, timeout_s, poll_s=0.2)


def stop(*procs: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM to every process still running, then wait for each (SIGKILL after
    `timeout_s`): they shut down side by side, not one after the other."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def stack_processes(
    settings: Settings, host: str, port: int, logs: Path, timeout_s: float = 120.0
) -> Iterator[tuple[str, subprocess.Popen, subprocess.Popen]]:
    """Gateway and worker as child processes; yields the gateway URL, the gateway and the
    worker once the gateway is healthy.

    Port 0 picks a free port. Both stop on exit.
    """
    logs.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    settings = with_secrets(settings)
    worker = start_worker(settings, logs / "worker.log")
    gateway = start_gateway(settings, host, port, logs / "gateway.log")
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, gateway, timeout_s=timeout_s)
        yield url, gateway, worker
    finally:
        stop(gateway, worker)


@contextlib.contextmanager
def embedded_stack(settings: Settings, host: str, port: int, logs: Path) -> Iterator[str]:
    """Gateway and worker as child processes; yields the gateway URL once healthy."""
    with stack_processes(settings, host, port, logs) as (url, _, _):
        yield url
