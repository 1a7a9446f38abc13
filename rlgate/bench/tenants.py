"""`rlgate bench tenants`: what one more LoRA run costs the gateway, and its hot swap.

Memory: a real gateway (and worker) on the embedded stack serves 1, then 8
LoRA runs on one base model (rank `--rank`, the default target modules),
each answering a request; one of them then trains a step and hot-swaps its
adapter. The gateway's resident memory (VmRSS) is read after the first run
answered and after all of that; `memory_ratio` = the growth / the bytes of
one full copy of the model's weights (float32), i.e. what the 7 extra runs
cost as a fraction of giving each its own model. Runs still at version 0
serve the base model itself and hold no adapter yet, so the measured growth
is the runs' own overhead plus one trained adapter;
`memory_ratio_all_trained` adds the adapter bytes the other runs would hold
once each had trained (`(runs - 1) x adapter / model`, the docs/lora.md arithmetic).

Policies (`--policies N`, 0 skips): the same stack serves one run with N
policies (docs/policies.md), rank `--rank` on `--policy-targets`; each policy
trains one step and answers again. The gateway's and the worker's RSS are
read once the first policy trained and once all N did: `policy_gateway_ratio`
and `policy_worker_ratio` = N x (the growth / (N - 1)) / one model copy, what N
policies' adapters (and, in the worker, their AdamW state) cost against a copy
of the model each.

Swap: in this process, one `LocalBackend` on the same base times
`load_adapter` (the trained adapter, what a LoRA run's hot swap does) against
`load_weights` (a full checkpoint, what a full fine-tune's hot swap does):
the call, which returns once every later batch uses the new weights; medians
of `--repeats`. `swap_ratio` = adapter swap / full swap. The last printed
line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlgate.bench import dirs as bench_dirs

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

ADMIN_KEY = "bench-tenants-admin-key"
PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Pick a number from 1 to 5."}
]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="smollm2", help="tiny, smollm2 or a local HF directory")
    p.add_argument("--runs", type=int, default=8, help="LoRA runs served at the end")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="swaps timed, of each kind")
    p.add_argument("--policies", type=int, default=8, help="policies of one run; 0: skip")
    p.add_argument(
        "--policy-targets",
        default="q_proj,v_proj",
        help="the policies' lora_target_modules, comma-separated",
    )
    bench_dirs.add_dir_arguments(p, "the stack's data dir (checkpoints) and logs")
    return p


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _ask(run: dict, episode: str, temperature: float = 0.0) -> str:
    """One call of `run` (`run["name"]` is the `model` asked for: a run, or a policy's
    `<run name>/<policy>`)."""
    import openai

    root = run["base_url"].removesuffix("/v1")
    agent = openai.OpenAI(base_url=f"{root}{episode}/v1", api_key=run["api_key"], max_retries=0)
    reply = agent.chat.completions.create(
        model=run["name"], messages=PROMPT, max_tokens=8, temperature=temperature
    )
    return reply.id


def _train_one_step(admin, run: dict, group_size: int) -> None:
    """Rewarded groups (reward: the answer's position in the group) until v1 is served."""
    import httpx

    headers = {"Authorization": f"Bearer {run['api_key']}"}
    for wave in range(20):
        for e in range(group_size):
            cid = _ask(run, f"/groups/w{wave}/episodes/w{wave}-{e}", temperature=1.0)
            body = {"completion_id": cid, "reward": float(e)}
            httpx.post(run["base_url"] + "/rewards", json=body, headers=headers).raise_for_status()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if admin.get(f"/admin/v1/runs/{run['run_id']}").json()["served_version"] == 1:
                return
            time.sleep(0.5)
    raise RuntimeError(f"run {run['run_id']} never served version 1")


def measure_memory(args: argparse.Namespace, base: Path, cache: Path, work: Path) -> dict:
    """Gateway RSS with one LoRA run served, then with `args.runs` served and one trained."""
    import httpx

    from rlgate.stack import stack_processes

    settings = bench_dirs.stack_settings(work, cache, ADMIN_KEY)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    config = {"lora_rank": args.rank, "group_size": 2, "groups_per_step": 1, "micro_batch_size": 2}
    with stack_processes(settings, "127.0.0.1", 0, work, timeout_s=300) as (url, gateway, _):
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=600) as admin:
            runs = []
            for i in range(args.runs):
                body = {"name": f"tenant-{i}", "model": args.model, "config": config}
                runs.append(admin.post("/admin/v1/runs", json=body).raise_for_status().json())
                _ask(runs[-1], f"/episodes/first-{i}")
                if i == 0:
                    one = rss_bytes(gateway.pid)
                    print(f"1 LoRA run served: gateway RSS {one / 1e6:.0f} MB", flush=True)
            _train_one_step(admin, runs[0], config["group_size"])
            for i, run in enumerate(runs):
                _ask(run, f"/episodes/again-{i}")
            many = rss_bytes(gateway.pid)
    print(f"{args.runs} LoRA runs served, one trained: gateway RSS {many / 1e6:.0f} MB")
    return {"rss_1_run": one, f"rss_{args.runs}_runs": many, "rss_growth": many - one}


def measure_policies(args: argparse.Namespace, cache: Path, work: Path) -> dict[str, int]:
    """Gateway and worker RSS once the first of `args.policies` policies of one run trained,
    and once every one did (each then answering with its adapter)."""
    import httpx

    from rlgate.stack import stack_processes

    settings = bench_dirs.stack_settings(work, cache, ADMIN_KEY)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    n = args.policies
    config = {
        "lora_rank": args.rank,
        "lora_target_modules": args.policy_targets.split(","),
        "group_size": 2,
        "groups_per_step": 1,
        "micro_batch_size": 2,
        "policies": {f"p{i}": {} for i in range(n)},
    }
    with stack_processes(settings, "127.0.0.1", 0, work, timeout_s=300) as stack:
        url, gateway, worker = stack
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=600) as admin:
            body = {"name": "team", "model": args.model, "config": config}
            run = admin.post("/admin/v1/runs", json=body).raise_for_status().json()
            ids = {
                r["policy"]: r["run_id"]
                for r in admin.get("/admin/v1/runs").json()
                if r["parent_id"] == run["run_id"]
            }
            policies = [{**run, "run_id": ids[f"p{i}"], "name": f"team/p{i}"} for i in range(n)]
            rss: dict[str, int] = {}
            for i, policy in enumerate(policies):
                _train_one_step(admin, policy, config["group_size"])
                _ask(policy, f"/episodes/after-{i}")
                if i == 0:
                    rss = {"gateway": rss_bytes(gateway.pid), "worker": rss_bytes(worker.pid)}
                    print(
                        f"1 policy trained: gateway {rss['gateway'] / 1e6:.0f} MB, "
                        f"worker {rss['worker'] / 1e6:.0f} MB",
                        flush=True,
                    )
            for i, policy in enumerate(policies):
                _ask(policy, f"/episodes/again-{i}")
            gateway_n, worker_n = rss_bytes(gateway.pid), rss_bytes(worker.pid)
    print(f"{n} policies trained: gateway {gateway_n / 1e6:.0f} MB, worker {worker_n / 1e6:.0f} MB")
    return {
        "policy_gateway_rss_1": rss["gateway"],
        f"policy_gateway_rss_{n}": gateway_n,
        "policy_gateway_growth": gateway_n - rss["gateway"],
        "policy_worker_rss_1": rss["worker"],
        f"policy_worker_rss_{n}": worker_n,
        "policy_worker_growth": worker_n - rss["worker"],
    }


async def _timed_swap(backend, swap, adapter: str | None, version: int) -> float:
    """Seconds the swap call takes: when it returns, every later batch uses the new weights.

    One request after it checks that they serve (not timed: it costs the same either way).
    """
    from inference.types import GenerateRequest, SamplingParams

    t0 = time.perf_counter()
    await swap
    seconds = time.perf_counter() - t0
    request = GenerateRequest([1, 2, 3, 4], SamplingParams(max_tokens=1), adapter=adapter)
    if (await backend.generate(request)).policy_version != version:
        raise RuntimeError("the swapped weights do not serve")
    return seconds


async def measure_swaps(base: Path, adapter: Path, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` adapter swaps and `repeats` full-weight swaps on one backend,
    after one untimed swap of each (both files then come from the page cache, as a
    checkpoint the trainer has just written does)."""
    from inference.local import LocalBackend

    backend = LocalBackend(base, batch_wait_s=0.0)
    try:
        adapters, fulls = [], []
        for v in range(repeats + 1):
            a = await _timed_swap(backend, backend.load_adapter("run", adapter, v), "run", v)
            f = await _timed_swap(backend, backend.load_weights(base, v), None, v)
            if v > 0:
                adapters.append(a)
                fulls.append(f)
        return adapters, fulls
    finally:
        await backend.close()


def model_bytes(model_dir: Path) -> int:
    """Bytes of one float32 copy of the model's weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return 4 * sum(p.numel() for p in model.parameters())


def policy_figures(args: argparse.Namespace, policies: dict[str, int], full_bytes: int) -> dict:
    """`policies` (what `measure_policies` returns) with the N policies' ratios to one model."""
    if not policies:
        return {}
    n = args.policies
    per_policy = {
        side: policies[f"policy_{side}_growth"] / max(n - 1, 1) for side in ("gateway", "worker")
    }
    return {
        "policies": n,
        "policy_targets": args.policy_targets.split(","),
        **policies,
        "policy_gateway_ratio": n * per_policy["gateway"] / full_bytes,
        "policy_worker_ratio": n * per_policy["worker"] / full_bytes,
    }


def summary(
    args: argparse.Namespace,
    memory: dict[str, int],
    full_bytes: int,
    adapter_size: int,
    adapters: list[float],
    fulls: list[float],
    policies: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The bench's JSON: memory of the extra runs and adapter swap seconds, each against a full
    model's (`memory` is what `measure_memory` returns), and the policies' memory."""
    adapter_s, full_s = statistics.median(adapters), statistics.median(fulls)
    return {
        "bench": "tenants",
        "model": args.model,
        "runs": args.runs,
        "rank": args.rank,
        **memory,
        "model_bytes": full_bytes,
        "adapter_bytes": adapter_size,
        "memory_ratio": memory["rss_growth"] / full_bytes,
        "memory_ratio_all_trained": (memory["rss_growth"] + (args.runs - 2) * adapter_size)
        / full_bytes,
        "adapter_swap_s": adapter_s,
        "full_swap_s": full_s,
        "swap_ratio": adapter_s / full_s,
        "repeats": args.repeats,
        **policy_figures(args, policies or {}, full_bytes),
    }


def trained_adapter(root: Path) -> Path:
    """The adapter the trained run wrote for version 1 (an attempt directory of the layout)."""
    from core.store.checkpoints import CheckpointLayout

    found = [
        path
        for path in sorted(root.glob("*/*"))
        if CheckpointLayout.attempt_version(path) == 1 and any(path.glob("adapter_*"))
    ]
    if not found:
        raise RuntimeError(f"no version 1 checkpoint under {root}")
    return found[0]


def run(args: argparse.Namespace) -> int:
    from inference.models import resolve_model

    cache = bench_dirs.model_cache(args.cache_dir)
    base = resolve_model(args.model, cache)
    with bench_dirs.work_dir("tenants", args.work_dir) as work:
        memory = measure_memory(args, base, cache, work)
        adapter = trained_adapter(work / "data" / "checkpoints")
        adapters, fulls = asyncio.run(measure_swaps(base, adapter, args.repeats))
        adapter_size = sum(f.stat().st_size for f in adapter.glob("adapter_*"))
        policies = measure_policies(args, cache, work / "policies") if args.policies > 1 else {}
    full = model_bytes(base)
    result = summary(args, memory, full, adapter_size, adapters, fulls, policies)
    print(
        f"{args.runs - 1} extra LoRA runs: {memory['rss_growth'] / 1e6:.0f} MB = "
        f"{result['memory_ratio']:.1%} of one model ({result['model_bytes'] / 1e6:.0f} MB); "
        f"adapter swap {result['adapter_swap_s'] * 1e3:.0f} ms vs full swap "
        f"{result['full_swap_s'] * 1e3:.0f} ms: ratio {result['swap_ratio']:.3f}"
    )
    if policies:
        print(
            f"{args.policies} policies of one run: gateway {result['policy_gateway_ratio']:.3f}, "
            f"worker {result['policy_worker_ratio']:.3f} of one model"
        )
    print(json.dumps(result))
    return 0
