"""`rlgate bench gateway`: latency and 2xx throughput added by rlgate against LiteLLM's proxy.

One stand-in vLLM server (`inference.stub_server`: fixed latency, fixed
output tokens) is reached three ways, with the same load generator in one run:

* ``stub``: straight to the stub's OpenAI endpoint (the floor);
* ``rlgate``: through rlgate (a run with ``backend: vllm`` pointing at the
  stub, capture on, PostgreSQL store); with ``--workers 1,2`` one gateway per
  count, each its own run (``rlgate``, ``rlgate_w2``); with ``--baseline-src``
  also the gateway of another source tree (``rlgate_baseline``: before/after);
* ``litellm``: through LiteLLM's proxy (`bench_litellm.LITELLM_VERSION`, in
  its own venv) pointed at the stub.

Three modes: ``plain`` and ``stream``, ``POST /v1/completions`` with a
token-id prompt (what the stub's completions route takes; rlgate skips
templating and tokenization there), and ``chat``, ``POST
/v1/chat/completions`` as an agent calls it: a system prompt, two tools and a
four-message history, on a fresh episode path per request for rlgate
(``/episodes/<n>/v1/...``), so templating, tokenization and episode placement
are paid; the stub and LiteLLM get the same body on their chat route.

Mode by mode, the stub, the gateway, the baseline tree's gateway and LiteLLM
are up together and loaded in lockstep (`load.measure_together`): each load
runs on every one of them back to back, their order reversed from one load
to the next, so two targets that a ratio compares are loaded seconds apart.
A gateway of a further `--workers` count is measured after them, alone (each
gateway process holds up to 32 PostgreSQL connections). Latency: percentiles at
`latency_concurrency` clients. Throughput: the best 2xx requests/s over the
closed-loop levels (a 429 or 5xx is never throughput; both are reported
beside it), each counted after a `warmup` and started once the stub is idle
(`settle`). Every 2xx answer of each rlgate gateway, warm-ups included, is
then looked for in the database. The last line is JSON
(`bench_gateway_report.summary`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from rlgate.bench import dirs as bench_dirs
from rlgate.bench.gateway_report import BASELINE, figure_lines, load_line, summary, target_name
from rlgate.bench.load import Target, measure_together
from rlgate.cli_args import positive_int

TargetOf = Callable[[str, dict, str], Target]  # (mode, body, route) -> how to reach a target

PROMPT = list(range(100, 164))  # 64 prompt tokens
ADMIN_KEY = "bench-admin"
MODES = ("plain", "stream", "chat")
LEVELS = (32, 128, 512)
ROUNDS = 5  # loads per level, interleaved (`load.alternating`); a level's figure: the median
CHAT_MESSAGES = [
    {
        "role": "system",
        "content": "You are a careful coding agent working in a Python repository. Use the "
        "tools to look before you answer, cite the file you read, and answer in two sentences.",
    },
    {"role": "user", "content": "Which module defines the gateway's chat completions route?"},
    {"role": "assistant", "content": "I will list the gateway's routes package and read it."},
    {"role": "user", "content": "Go ahead, then tell me the file and the function's name."},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "repository path"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List the entries of a directory of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "depth": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
]


def mode_body(mode: str, output_tokens: int) -> dict[str, Any]:
    """The request body of `mode`, without its model."""
    if mode == "chat":
        return {"messages": CHAT_MESSAGES, "tools": CHAT_TOOLS, "max_tokens": output_tokens}
    return {"prompt": PROMPT, "max_tokens": output_tokens, "stream": mode == "stream"}


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


@contextlib.contextmanager
def _process(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[Any]:
    from rlgate.stack import stop

    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        yield proc
    finally:
        stop(proc)


def settle(stub: str, quiet_s: float = 1.0, timeout_s: float = 90.0) -> None:
    """Until the stub has started no request for `quiet_s` and has none in flight.

    Every target ends at the stub, so a proxy still working off the last load's
    queue (wrk has closed its connections, the proxy has not noticed) shows
    there as new requests.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        state = httpx.get(stub + "/stub/state", timeout=5).json()
        if state["requests"] != last or state["in_flight"]:
            last, quiet_since = state["requests"], time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.1)


def gateway_command(port: int, workers: int) -> list[str]:
    """How the bench starts rlgate: `rlgate.serve` (as `rlgate up` does), `workers` processes."""
    cmd = [sys.executable, "-m", "rlgate.serve", "--host", "127.0.0.1", "--port", str(port)]
    # 1: RLGATE_GATEWAY_WORKERS (`_start_gateway`), so that a gateway from before
    # `--workers` can be measured too
    return cmd + (["--workers", str(workers)] if workers != 1 else [])


def _start_gateway(
    stack: contextlib.ExitStack,
    tmp: Path,
    db: str,
    cache: Path,
    workers: int,
    src: Path | None = None,
) -> str:
    """A gateway with `workers` processes, its URL once it answers (stopped with `stack`).

    `src`: the gateway's code from that source tree instead (imported first, run from there).
    """
    from core.settings import Settings
    from rlgate.stack import free_port, settings_env, wait_healthy

    tag = f"w{workers}" + ("-baseline" if src else "")
    settings = Settings(
        data_dir=tmp / f"data-{tag}",
        database_url=db,
        admin_key=ADMIN_KEY,
        dev_mode=False,
        model_cache_dir=cache.resolve(),
    )
    port = free_port()
    log = tmp / f"gateway-{tag}.log"
    env = settings_env(settings) | {"RLGATE_GATEWAY_WORKERS": str(workers)}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    proc = stack.enter_context(_process(gateway_command(port, workers), log, env, src))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=180)
    except Exception as exc:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"rlgate --workers {workers} did not start: {exc}\n{tail}") from exc
    return url


def _create_run(url: str, name: str, stub: str) -> dict[str, Any]:
    import httpx

    resp = httpx.post(
        url + "/admin/v1/runs",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        json={
            "name": name,
            "model": "tiny",
            "backend": "vllm",
            "replicas": [stub],
            # thousands of conversations that nothing trains: the gateway path is measured,
            # not staleness-aware admission, whose cap (64 open episodes) would hold them
            "config": {"max_pending_episodes": 10**6},
        },
        timeout=120,
    )
    resp.raise_for_status()
    return resp.json()


def _rlgate_target(url: str, run: dict, mode: str, body: dict, route: str) -> Target:
    """rlgate: the run's key and name; chat on a fresh episode path per request."""
    path = "/episodes/{n}" + route if mode == "chat" else route
    return url, path, body | {"model": run["name"]}, {"Authorization": f"Bearer {run['api_key']}"}


def _litellm_target(url: str, key: str, mode: str, body: dict, route: str) -> Target:
    from rlgate.bench import litellm as bench_litellm

    model = bench_litellm.CHAT_MODEL if mode == "chat" else bench_litellm.TEXT_MODEL
    return url, route, body | {"model": model}, {"Authorization": f"Bearer {key}"}


def bench_gateway(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode's loads on each target in turn (`add_arguments` names the options)."""
    from inference.models import resolve_model
    from rlgate.bench import litellm as bench_litellm
    from rlgate.bench.capture import fresh_database
    from rlgate.bench.wrk import available
    from rlgate.stack import free_port

    loader, workers = args.load_generator, args.workers
    if loader == "auto":
        loader = "wrk" if available() else "python"
    print(f"load generator: {loader}", file=sys.stderr)
    cache_dir = bench_dirs.model_cache(args.cache_dir)
    resolve_model("tiny", cache_dir)  # the run's tokenizer; the stub stands in for its weights
    stub_port, lite_port = free_port(), free_port()
    stub_url, lite_url = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{lite_port}"
    stub_cmd = [sys.executable, "-m", "inference.stub_server", "--flavor", "vllm"]
    stub_cmd += ["--port", str(stub_port), "--latency-ms", str(args.latency_ms)]
    stub_cmd += ["--output-tokens", str(args.output_tokens)]
    lite_version = None
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}  # rlgate target -> its run, created on first start
    dbs: dict[str, str] = {}  # rlgate target -> the database its run is stored in

    @contextlib.contextmanager
    def rlgate(name: str, workers: int, src: Path | None) -> Iterator[TargetOf]:
        # another source tree's gateway gets a database of its own: its migrations may be
        # older than the ones this tree has already applied to `db`
        store = db if src is None else baseline_db
        with contextlib.ExitStack() as gateway:
            url = _start_gateway(gateway, tmp, store, cache_dir, workers, src)
            if name not in runs:
                runs[name] = _create_run(url, f"bench-{name}", stub_url)
                dbs[name] = store
            yield partial(_rlgate_target, url, runs[name])

    @contextlib.contextmanager
    def litellm() -> Iterator[TargetOf]:
        cmd = [str(lite_binary), "--config", str(tmp / "litellm.yaml")]
        cmd += ["--host", "127.0.0.1", "--port", str(lite_port)]
        with _process(cmd, tmp / "litellm.log") as lite:
            _wait_http(lite_url + "/health/liveliness", lite)
            yield partial(_litellm_target, lite_url, lite_key)

    def stub_target(mode: str, body: dict, route: str) -> Target:
        return stub_url, route, body | {"model": "stub-model"}, {}

    # Mode by mode, the targets that a ratio compares are up together and loaded in lockstep
    # (`measure_together`): the stub, the first worker count's gateway, the baseline tree's
    # and LiteLLM. Each further worker count is measured after them, alone: two gateways of
    # 32 database connections a process, and a second of two processes, would not fit under
    # PostgreSQL's default 100.
    together: dict[str, Callable[[], contextlib.AbstractContextManager[TargetOf]]] = {
        "stub": lambda: contextlib.nullcontext(stub_target)
    }
    alone: dict[str, Callable[[], contextlib.AbstractContextManager[TargetOf]]] = {}
    for w in workers:
        name = target_name(w, workers[0])
        (together if w == workers[0] else alone)[name] = partial(rlgate, name, w, None)
    if args.baseline_src is not None:
        together[BASELINE] = partial(rlgate, BASELINE, workers[0], args.baseline_src.resolve())
    lite_key = "sk-" + secrets.token_hex(24)
    if not args.skip_litellm:
        lite_binary = bench_litellm.litellm_binary()  # installed now, not between two loads
        lite_version = bench_litellm.installed_version()
        together["litellm"] = litellm
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(bench_dirs.work_dir("gw", args.work_dir))  # removed last
        db = stack.enter_context(fresh_database(args.database_url))
        baseline_db = (
            stack.enter_context(fresh_database(args.database_url)) if args.baseline_src else db
        )
        bench_litellm.write_config(tmp / "litellm.yaml", stub_url, lite_key)
        stub = stack.enter_context(_process(stub_cmd, tmp / "stub.log"))
        _wait_http(stub_url + "/health", stub)
        loads = partial(
            measure_together,
            latency_c=args.latency_concurrency,
            levels=list(args.levels),
            seconds=args.seconds,
            loader=loader,
            settle=partial(settle, stub_url),
            warmup=args.warmup,
            rounds=args.rounds,
        )
        for mode in args.modes:
            route = "/v1/chat/completions" if mode == "chat" else "/v1/completions"
            body = mode_body(mode, args.output_tokens)
            with contextlib.ExitStack() as up:
                reach = {name: up.enter_context(start()) for name, start in together.items()}
                measured = loads({name: of(mode, body, route) for name, of in reach.items()})
            for name, start in alone.items():
                with start() as target_of:
                    measured |= loads({name: target_of(mode, body, route)})
            results[mode] = measured
            for name, m in measured.items():
                for level in (m["latency"], *m["throughput"]):
                    print(load_line(mode, name, level), file=sys.stderr)
        stored = {}
        for name, run in runs.items():
            answered = sum(
                level["requests"] + level["warm_2xx"] + level["warm_ok"]
                for r in results.values()
                for level in (r[name]["latency"], *r[name]["throughput"])
            )
            stored[name] = {"answered": answered, **_count_stored(dbs[name], run["run_id"])}
    return summary(
        results,
        list(workers),
        stored,
        not args.skip_litellm,
        litellm_version=lite_version,
        load_generator=loader,
        stub_latency_ms=args.latency_ms,
        output_tokens=args.output_tokens,
        seconds=args.seconds,
        warmup_s=args.warmup,
        rounds=args.rounds,
        latency_concurrency=args.latency_concurrency,
        levels=list(args.levels),
    )


def _count_stored(url: str, run_id: str) -> dict[str, int]:
    """What the gateway stored for the run: completions (every answer must be there), episodes."""
    from sqlalchemy.ext.asyncio import AsyncSession

    from core.store.completions import count_completions
    from core.store.db import make_async_engine
    from core.store.episodes import episode_counts

    async def count() -> dict[str, int]:
        engine = make_async_engine(url)
        try:
            async with AsyncSession(engine) as s:
                episodes = await episode_counts(s)
                return {
                    "stored": await count_completions(s, run_id),
                    "episodes": sum(n for (run, _), n in episodes.items() if run == run_id),
                }
        finally:
            await engine.dispose()

    return asyncio.run(count())


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(text.split(","))
    if unknown := set(modes) - set(MODES):
        raise argparse.ArgumentTypeError(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    return modes


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/test")
    bench_dirs.add_dir_arguments(p, "the gateway's data dir and the processes' logs")
    p.add_argument("--latency-ms", type=float, default=20.0, help="stub time to first token")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument(
        "--seconds", "--duration", type=float, default=5.0, help="per load (1 for a quick check)"
    )
    p.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of each load left out of its figures"
    )
    p.add_argument("--latency-concurrency", type=int, default=4)
    p.add_argument(
        "--levels",
        type=_int_list,
        default=LEVELS,
        help="closed-loop concurrencies for max 2xx req/s (default 32,128,512)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=ROUNDS,
        help="loads per level, levels in alternating order; each level's figures are the "
        f"rounds' medians (default {ROUNDS})",
    )
    p.add_argument(
        "--workers",
        type=_int_list,
        default=(1,),
        help="gateway processes; a list (1,2) measures one gateway per count in the same run",
    )
    p.add_argument("--modes", type=_modes, default=MODES, help="default plain,stream,chat")
    p.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="a source tree of rlgate from before a change (git worktree, git archive): "
        "its gateway is measured in the same run as `rlgate_baseline`",
    )
    p.add_argument("--skip-litellm", action="store_true", help="stub and rlgate only")
    p.add_argument(
        "--load-generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="auto: wrk when it is on PATH (apt-get install wrk), else asyncio + httpx",
    )
    return p


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: the servers stop, the bench database is dropped


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    out = bench_gateway(args)
    if out["litellm_version"]:
        print(f"LiteLLM {out['litellm_version']}")
    for line in figure_lines(out):
        print(line)
    print(json.dumps(out))
    return 0 if out["all_stored"] else 1
