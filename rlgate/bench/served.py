"""`rlgate bench served`: seconds from an agent's last reward to the new version being served.

What a new user sees with `rlgate up`: the embedded stack (gateway, Celery
worker, local backend) as child processes, a run per engine setting, and an
agent loop through the OpenAI SDK: `groups` groups of `group_size` episodes
(one chat completion of `max_tokens` each, the same prompts every step,
rewards 0 and 1 alternating so that every group trains), then the rewards.
The clock starts when the last reward is acknowledged and stops when the
run's `served_version` is the new version (polled every 0.1 s), so it holds
the scheduler's claim, the Celery hand-off, the train step with its
checkpoint, and the hot swap.

Settings, all in one run and interleaved step by step so that drift on a
shared machine hits them alike:

- `local`: the local engine (the baseline of every ratio);
- `fsdp<N>`: `engine: fsdp, world_size: N` on resident ranks.

Medians over `steps` steps; `served_ratio` per setting = its median / local's.
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack
from typing import Any

from rlgate.bench.dirs import add_dir_arguments, model_cache, work_dir

ADMIN_KEY = "bench-served-admin"
PROMPTS = ("What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three.")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="smollm2", help="smollm2, tiny or a local HF directory")
    add_dir_arguments(p, work="the stacks' data directories")
    p.add_argument("--steps", type=int, default=3, help="steps per setting")
    p.add_argument("--groups", type=int, default=2, help="groups per step")
    p.add_argument("--group-size", type=int, default=4, help="episodes per group")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--world-sizes", default="1,2", help="FSDP settings, comma-separated")
    return p


def _play(base_url: str, api_key: str, name: str, tag: str, args: argparse.Namespace) -> None:
    """One step's episodes and their rewards; returns once the last reward is acknowledged."""
    import openai

    root = base_url.removesuffix("/v1")
    for g in range(args.groups):
        for e in range(args.group_size):
            client = openai.OpenAI(
                base_url=f"{root}/groups/{tag}-g{g}/episodes/{tag}-g{g}-e{e}/v1", api_key=api_key
            )
            resp = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPTS[g % len(PROMPTS)]}],
                max_tokens=args.max_tokens,
            )
            body = {"completion_id": resp.id, "reward": float(e % 2)}
            client.post("/rewards", body=body, cast_to=object)


def _wait_served(admin: Any, run_id: str, version: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = admin.get(f"/admin/v1/runs/{run_id}").json()
        if (info.get("served_version") or 0) >= version:
            return
        time.sleep(0.1)
    raise RuntimeError(f"run {run_id} never served v{version}")


def run(args: argparse.Namespace) -> int:
    import httpx

    from core.settings import Settings
    from rlgate.stack import embedded_stack

    cache = model_cache(args.cache_dir)
    sizes = [int(w) for w in args.world_sizes.split(",") if w]
    engines: dict[str, dict[str, Any]] = {"local": {}}
    for w in sizes:
        engines[f"fsdp{w}"] = {"engine": "fsdp", "world_size": w}
    with work_dir("served", args.work_dir) as work, ExitStack() as stack:
        settings = Settings(
            data_dir=work / "data", admin_key=ADMIN_KEY, dev_mode=False, model_cache_dir=cache
        )
        url = stack.enter_context(embedded_stack(settings, "127.0.0.1", 0, work))
        admin = stack.enter_context(
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=600
            )
        )
        created = {}
        for name, engine in engines.items():
            config = {
                "group_size": args.group_size,
                "groups_per_step": args.groups,
                "micro_batch_size": args.group_size,
                **engine,
            }
            body = {"name": name, "model": str(args.model), "config": config}
            r = admin.post("/admin/v1/runs", json=body)
            r.raise_for_status()
            created[name] = r.json()
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        for step in range(args.steps):
            for name, run_info in created.items():
                _play(run_info["base_url"], run_info["api_key"], name, f"s{step}", args)
                t0 = time.perf_counter()
                _wait_served(admin, run_info["run_id"], step + 1)
                seconds[name].append(time.perf_counter() - t0)
                print(f"{name} step {step}: {seconds[name][-1]:.2f} s", flush=True)
    result = summary(str(args.model), args.steps, seconds)
    med = result["median_s"]
    print(
        f"reward -> served ({args.model}, {args.groups} x {args.group_size} episodes, "
        f"{args.max_tokens} tokens, median of {args.steps} steps, interleaved):"
    )
    for name, m in med.items():
        print(f"  {name}: {m:.2f} s  ({m / med['local']:.2f}x local)")
    print(json.dumps(result))
    return 0


def summary(model: str, steps: int, seconds: dict[str, list[float]]) -> dict[str, Any]:
    """The bench's JSON: each run's seconds from last reward to served, medians against local."""
    med = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "bench": "served",
        "model": model,
        "steps": steps,
        "seconds": seconds,
        "median_s": med,
        "served_ratio": {name: m / med["local"] for name, m in med.items() if name != "local"},
    }


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="rlgate bench served", description=doc)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
