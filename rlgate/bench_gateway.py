"""`rlgate bench gateway`: latency and throughput added by rlgate against LiteLLM's proxy.

One stand-in vLLM server (`inference.stub_server`: fixed latency, fixed
output tokens) is reached three ways, with the same load generator
(asyncio + httpx) and the same request, in one run:

* ``stub``: straight to the stub's OpenAI endpoint (the floor);
* ``rlgate``: through rlgate (a run with ``backend: vllm`` pointing at the
  stub, capture on, PostgreSQL store);
* ``litellm``: through LiteLLM's proxy pointed at the stub's OpenAI endpoint
  (installed into its own venv, `~/.cache/rlgate/litellm-venv`, made on
  first use: it pins packages that conflict with rlgate's).

The request is ``POST /v1/completions`` with a token-id prompt (the stub's
OpenAI endpoint takes token ids only), non-streaming and streaming.
Latency: percentiles at `latency_concurrency` clients. Throughput: the
highest completed requests/s over the closed-loop concurrency levels. The
ratios: rlgate's added p50 latency (its p50 minus the stub's) over
LiteLLM's, and rlgate's max requests/s over LiteLLM's. Every completion
rlgate answered is then counted in the database. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlgate import bench_dirs

LITELLM_VENV = Path.home() / ".cache" / "rlgate" / "litellm-venv"
PROMPT = list(range(100, 164))  # 64 prompt tokens
ADMIN_KEY = "bench-admin"


def litellm_binary(venv: Path = LITELLM_VENV) -> Path:
    """LiteLLM's proxy in its own venv, created (pip install 'litellm[proxy]') if missing."""
    binary = venv / "bin" / "litellm"
    if not binary.exists():
        print(f"installing litellm[proxy] into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "litellm[proxy]"]
        subprocess.run(pip, check=True)
    return binary


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


@contextlib.contextmanager
def _process(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    from rlgate.stack import stop

    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        stop(proc)


async def _one(client, url: str, body: dict, headers: dict) -> float:
    t0 = time.perf_counter()
    if not body.get("stream"):
        resp = await client.post(url, json=body, headers=headers)
        resp.raise_for_status()
        if not resp.json().get("choices"):
            raise RuntimeError(f"no choices from {url}")
    else:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            resp.raise_for_status()
            done = False
            async for line in resp.aiter_lines():
                done = done or line.strip() == "data: [DONE]"
            if not done:
                raise RuntimeError(f"stream from {url} ended without [DONE]")
    return time.perf_counter() - t0


async def _load(url: str, body: dict, headers: dict, concurrency: int, seconds: float) -> dict:
    """Closed loop: `concurrency` clients, each sending its next request when one ends."""
    import httpx

    latencies: list[float] = []
    errors = 0
    # keepalive_expiry under uvicorn's 5 s: never reuse a connection the server is closing
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        await _one(client, url, body, headers)  # warm: connections, lazy loading
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                try:
                    latencies.append(await _one(client, url, body, headers))
                except (httpx.HTTPError, RuntimeError, ValueError):
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": errors,
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p90_ms": round(q[89] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
    }


def _python_load(url: str, body: dict, headers: dict, concurrency: int, seconds: float) -> dict:
    return asyncio.run(_load(url, body, headers, concurrency, seconds))


def _wrk_load(url: str, body: dict, headers: dict, concurrency: int, seconds: float) -> dict:
    from rlgate.bench_wrk import wrk_load

    asyncio.run(_load(url, body, headers, 1, 0.0))  # warm: the python loader's first request
    return wrk_load(url, body, headers, concurrency, seconds)


def _measure(
    url: str,
    body: dict,
    headers: dict,
    latency_c: int,
    levels: list[int],
    seconds: float,
    loader: str = "python",
) -> dict:
    load = _wrk_load if loader == "wrk" else _python_load
    latency = load(url, body, headers, latency_c, seconds)
    loads = [load(url, body, headers, c, seconds) for c in levels]
    best = max(loads, key=lambda m: m["rps"])
    return {"latency": latency, "throughput": loads, "max_rps": best["rps"]}


def _litellm_config(path: Path, stub: str, master_key: str) -> None:
    # text-completion-openai forwards /v1/completions (token-id prompts included) as is.
    # The master key: LiteLLM checks a credential per request, as rlgate checks the run key.
    path.write_text(
        "model_list:\n"
        "  - model_name: stub-model\n"
        "    litellm_params:\n"
        "      model: text-completion-openai/stub-model\n"
        f"      api_base: {stub}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
    )


def bench_gateway(
    database_url: str = "postgresql://postgres@127.0.0.1:5432/test",
    cache_dir: Path | None = None,
    latency_ms: float = 20.0,
    output_tokens: int = 16,
    seconds: float = 5.0,
    latency_concurrency: int = 4,
    levels: tuple[int, ...] = (32, 128),
    skip_litellm: bool = False,
    loader: str = "auto",
    work_dir: Path | None = None,
) -> dict[str, Any]:
    import httpx

    from rlgate.bench_wrk import available

    if loader == "auto":
        loader = "wrk" if available() else "python"
    print(f"load generator: {loader}", file=sys.stderr)

    from inference.models import resolve_model
    from rlgate.bench_capture import fresh_database
    from rlgate.settings import Settings
    from rlgate.stack import free_port, settings_env, wait_healthy

    cache_dir = bench_dirs.model_cache(cache_dir)
    resolve_model("tiny", cache_dir)  # the run's tokenizer; the stub stands in for its weights
    ports = {name: free_port() for name in ("stub", "rlgate", "litellm")}
    urls = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
    stub_cmd = [sys.executable, "-m", "inference.stub_server", "--flavor", "vllm"]
    stub_cmd += ["--port", str(ports["stub"]), "--latency-ms", str(latency_ms)]
    stub_cmd += ["--output-tokens", str(output_tokens)]
    body = {"prompt": PROMPT, "max_tokens": output_tokens, "temperature": 1.0}
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(bench_dirs.work_dir("gw", work_dir))  # removed last
        db = stack.enter_context(fresh_database(database_url))
        settings = Settings(
            data_dir=tmp / "data",
            database_url=db,
            admin_key=ADMIN_KEY,
            dev_mode=False,
            model_cache_dir=cache_dir.resolve(),
        )
        stub = stack.enter_context(_process(stub_cmd, tmp / "stub.log"))
        gw_cmd = [sys.executable, "-m", "rlgate.serve", "--host", "127.0.0.1"]
        gw_cmd += ["--port", str(ports["rlgate"])]
        gateway = stack.enter_context(_process(gw_cmd, tmp / "gateway.log", settings_env(settings)))
        _wait_http(urls["stub"] + "/health", stub)
        wait_healthy(urls["rlgate"], gateway, timeout_s=180)
        run = httpx.post(
            urls["rlgate"] + "/admin/v1/runs",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            json={
                "name": "bench",
                "model": "tiny",
                "backend": "vllm",
                "replicas": [urls["stub"]],
                # thousands of conversations that nothing trains: the gateway path is measured,
                # not staleness-aware admission, whose cap (64 open episodes) would hold them
                "config": {"max_pending_episodes": 10**6},
            },
            timeout=120,
        ).json()
        targets = {
            "stub": (urls["stub"] + "/v1/completions", {"model": "stub-model"}, {}),
            "rlgate": (
                urls["rlgate"] + "/v1/completions",
                {"model": "bench"},
                {"Authorization": f"Bearer {run['api_key']}"},
            ),
        }
        if not skip_litellm:
            lite_key = "sk-" + secrets.token_hex(24)
            _litellm_config(tmp / "litellm.yaml", urls["stub"], lite_key)
            lite_cmd = [str(litellm_binary()), "--config", str(tmp / "litellm.yaml")]
            lite = stack.enter_context(
                _process(
                    [*lite_cmd, "--host", "127.0.0.1", "--port", str(ports["litellm"])],
                    tmp / "litellm.log",
                )
            )
            _wait_http(urls["litellm"] + "/health/liveliness", lite)
            targets["litellm"] = (
                urls["litellm"] + "/v1/completions",
                {"model": "stub-model"},
                {"Authorization": f"Bearer {lite_key}"},
            )
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            for name, (url, extra, headers) in targets.items():
                req = body | extra | {"stream": stream}
                m = _measure(url, req, headers, latency_concurrency, list(levels), seconds, loader)
                results.setdefault(mode, {})[name] = m
                print(
                    f"{mode:6} {name:8} p50 {m['latency']['p50_ms']:8.2f} ms  "
                    f"p99 {m['latency']['p99_ms']:8.2f} ms  max {m['max_rps']:8.1f} req/s",
                    file=sys.stderr,
                )
        answered = sum(
            m["requests"] + 1  # + the warm-up request of each load
            for mode in results.values()
            for m in (mode["rlgate"]["latency"], *mode["rlgate"]["throughput"])
        )
        stored = _count_completions(db, run["run_id"])
    out = _summary(results, answered, stored, latency_ms, output_tokens, skip_litellm)
    out["load_generator"] = loader
    return out


def _count_completions(url: str, run_id: str) -> int:
    """What the gateway stored for the run (every answered request must be there)."""
    from sqlalchemy.ext.asyncio import AsyncSession

    from gateway.store.completions import count_completions
    from gateway.store.db import make_async_engine

    async def count() -> int:
        engine = make_async_engine(url)
        try:
            async with AsyncSession(engine) as s:
                return await count_completions(s, run_id)
        finally:
            await engine.dispose()

    return asyncio.run(count())


def _summary(results, answered, stored, latency_ms, output_tokens, skip_litellm) -> dict:
    out: dict[str, Any] = {
        "bench": "gateway",
        "stub_latency_ms": latency_ms,
        "output_tokens": output_tokens,
        "rlgate_answered": answered,
        "rlgate_stored": stored,
        "modes": results,
    }
    for mode, r in results.items():
        floor = r["stub"]["latency"]["p50_ms"]
        figures = {"rlgate_added_p50_ms": round(r["rlgate"]["latency"]["p50_ms"] - floor, 2)}
        if not skip_litellm:
            lite_added = r["litellm"]["latency"]["p50_ms"] - floor
            figures["litellm_added_p50_ms"] = round(lite_added, 2)
            figures["overhead_ratio"] = round(figures["rlgate_added_p50_ms"] / lite_added, 3)
            figures["throughput_ratio"] = round(r["rlgate"]["max_rps"] / r["litellm"]["max_rps"], 2)
        out[mode] = figures
    if not skip_litellm:  # the contract's top-level figures: the non-streaming mode
        out["overhead_ratio"] = out["plain"]["overhead_ratio"]
        out["throughput_ratio"] = out["plain"]["throughput_ratio"]
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/test")
    bench_dirs.add_dir_arguments(p, "the gateway's data dir and the processes' logs")
    p.add_argument("--latency-ms", type=float, default=20.0, help="stub time to first token")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0, help="per load level")
    p.add_argument("--latency-concurrency", type=int, default=4)
    p.add_argument("--levels", default="32,128", help="closed-loop concurrencies for max req/s")
    p.add_argument("--skip-litellm", action="store_true", help="stub and rlgate only")
    p.add_argument(
        "--load-generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="auto: wrk when it is on PATH (apt-get install wrk), else asyncio + httpx",
    )
    return p


def run(args: argparse.Namespace) -> int:
    out = bench_gateway(
        args.database_url,
        args.cache_dir,
        args.latency_ms,
        args.output_tokens,
        args.seconds,
        args.latency_concurrency,
        tuple(int(c) for c in args.levels.split(",")),
        args.skip_litellm,
        args.load_generator,
        args.work_dir,
    )
    for mode in ("plain", "stream"):
        print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in out[mode].items()))
    print(f"rlgate answered {out['rlgate_answered']}, stored {out['rlgate_stored']}")
    print(json.dumps(out))
    return 0 if out["rlgate_stored"] >= out["rlgate_answered"] else 1
