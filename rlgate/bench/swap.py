"""`rlgate bench swap`: seconds to put new weights into vLLM, hot swap against a restart.

One vLLM server (the flags of `rlgate inference serve`) serves the model.
Hot swap is `VLLMBackend.load_weights` (pause, in-place reload, resume;
nothing is in flight, so keep and drain do the same), timed from the call
until a greedy request answers on the new weights. Restart is what a system
without hot swap does: stop the server, start it on the new checkpoint, wait
until it answers the same request. Both write no checkpoint (it is written
once before timing). `repeats` hot swaps (alternating two checkpoints) and
`restarts` restarts are timed; medians are reported and `ratio` = hot-swap
seconds / restart seconds. The last printed line is one JSON object.

`--stall` measures instead what a swap costs agents that are streaming
through it, `drain` against `keep` (`rlgate.bench.swap_stall`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.launch import ServerConfig, start_server, stop_server, wait_ready
from rlgate.bench import dirs as bench_dirs

if TYPE_CHECKING:  # pydantic-settings is imported only when the bench runs
    from core.settings import Settings


def perturbed_checkpoint(model_dir: Path, out: Path) -> Path:
    """A second, different set of weights to swap to (written once, not timed)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    for f in model_dir.iterdir():  # a restart on this directory needs the tokenizer too
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and f.is_file():
            shutil.copy2(f, out / f.name)
    return out


async def _first_answer(url: str, version: int, ckpt: Path | None) -> float:
    """Swap `ckpt` into the server at `url` (if given) and wait for one greedy answer."""
    from inference.types import GenerateRequest, SamplingParams
    from inference.vllm_http import VLLMBackend

    backend = VLLMBackend.for_url(url)
    try:
        t0 = time.perf_counter()
        if ckpt is not None:
            await backend.load_weights(ckpt, version)
        await backend.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=1)))
        return time.perf_counter() - t0
    finally:
        await backend.close()


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a local HF directory")
    p.add_argument("--python", default=None, help="vLLM's python (default: its cached venv)")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--repeats", type=int, default=5, help="hot swaps timed")
    p.add_argument("--restarts", type=int, default=2, help="restarts timed")
    p.add_argument("--max-model-len", type=int, default=512)
    bench_dirs.add_dir_arguments(p, "the second checkpoint and the server's log")
    stall = p.add_argument_group("stall mode (--stall): drain vs keep while agents stream")
    stall.add_argument("--stall", action="store_true", help="measure the stall, not the restart")
    stall.add_argument("--seconds", type=float, default=120.0, help="per mode, stand-in setup")
    stall.add_argument("--agents", type=int, default=64, help="streaming agents, stand-in setup")
    stall.add_argument("--swap-every", type=float, default=10.0, help="seconds between swaps")
    stall.add_argument(
        "--reload-ms", type=float, default=300.0, help="the stand-in's reload, server paused"
    )
    stall.add_argument(
        "--think-ms", type=float, default=0.0, help="an agent's pause between calls, at most"
    )
    stall.add_argument(
        "--vllm-streams", type=int, default=4, help="streams against vLLM (0: skip vLLM)"
    )
    stall.add_argument("--vllm-seconds", type=float, default=60.0, help="per mode, vLLM setup")
    stall.add_argument("--vllm-swap-every", type=float, default=15.0, help="vLLM setup")
    stall.add_argument("--vllm-model", default="smollm2", help="model of the vLLM setup")
    return p


def _time_swaps(
    args: argparse.Namespace, settings: Settings, base: Path, work: Path
) -> tuple[list[float], list[float]]:
    """Seconds of each hot swap and of each restart, alternating `base` and a second checkpoint."""
    from rlgate.inference_cli import server_python

    other = perturbed_checkpoint(base, work / "ckpt-b")
    checkpoints = [other, base]

    def config(model_dir: Path) -> ServerConfig:
        return ServerConfig(
            kind="vllm",
            model_dir=model_dir,
            python=server_python("vllm", args.python, settings),
            port=args.port,
            max_model_len=args.max_model_len,
        )

    log = work / "vllm.log"
    proc = start_server(config(base), log)
    swaps: list[float] = []
    restarts: list[float] = []
    try:
        wait_ready(config(base).url, proc, timeout_s=900)
        asyncio.run(_first_answer(config(base).url, 0, None))  # warm-up
        for i in range(args.repeats):
            ckpt = checkpoints[i % 2]
            swaps.append(asyncio.run(_first_answer(config(base).url, i + 1, ckpt)))
            print(f"hot swap {i + 1}/{args.repeats}: {swaps[-1]:.3f} s", flush=True)
        for i in range(args.restarts):
            ckpt = checkpoints[i % 2]
            t0 = time.perf_counter()
            stop_server(proc)
            proc = start_server(config(ckpt), log)
            wait_ready(config(ckpt).url, proc, timeout_s=900)
            asyncio.run(_first_answer(config(ckpt).url, 0, None))
            restarts.append(time.perf_counter() - t0)
            print(f"restart {i + 1}/{args.restarts}: {restarts[-1]:.1f} s", flush=True)
    finally:
        stop_server(proc)
    return swaps, restarts


def summary(model: str, swaps: list[float], restarts: list[float]) -> dict[str, Any]:
    """The bench's JSON: median seconds of a hot swap and of a restart, and their ratio."""
    swap_s, restart_s = statistics.median(swaps), statistics.median(restarts)
    return {
        "bench": "swap",
        "model": model,
        "hot_swap_s": swap_s,
        "restart_s": restart_s,
        "ratio": swap_s / restart_s,
        "speedup": restart_s / swap_s,
        "repeats": len(swaps),
        "restarts": len(restarts),
    }


def run(args: argparse.Namespace) -> int:
    if args.stall:
        from rlgate.bench import swap_stall

        return swap_stall.run(args)
    from core.settings import Settings
    from inference.models import resolve_model

    settings = Settings()
    base = resolve_model(args.model, bench_dirs.model_cache(args.cache_dir))
    with bench_dirs.work_dir("swap", args.work_dir) as work:
        swaps, restarts = _time_swaps(args, settings, base, work)
    result = summary(args.model, swaps, restarts)
    swap_s, restart_s = result["hot_swap_s"], result["restart_s"]
    print(
        f"hot swap {swap_s:.3f} s vs restart {restart_s:.1f} s: ratio {result['ratio']:.4f} "
        f"({result['speedup']:.0f}x faster)"
    )
    print(json.dumps(result))
    return 0
