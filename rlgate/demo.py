"""`rlgate demo`: the whole loop on the embedded default, with plain OpenAI-SDK agents.

With a remote backend (`--backend vllm`) the demo also starts its server (the
code of `rlgate inference serve`) and the gateway samples from it and
hot-swaps into it.

Per step: a wave of agents (groups of `group_size` attempts at the same
problem) call the gateway over HTTP, each reply is scored, rewards go back
through the REST API, the gateway enqueues a train step, the Celery worker
writes version N+1, and the gateway hot-swaps it in. The next wave samples
from N+1.

Held-out reward: at version 0, each time the version moves by `eval_every`,
and at the final version, the held-out problems (never drawn for training)
go through the run's `/eval` base_url, greedily, and their rewards are
posted like any other. The gateway serves and scores them but never trains
on them nor counts them against admission, so evaluating changes nothing in
the training loop. They run beside the first wave that version samples, so
the backend decodes them in the same batch instead of on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from core.settings import Settings, available_cores
from core.store.status import StepStatus
from rlgate.demo_task import Problem, heldout_problems, make_problem, score
from rlgate.stack import embedded_stack

logger = logging.getLogger(__name__)


@dataclass
class DemoConfig:
    model: str = "smollm2"
    steps: int = 16
    out: Path = Path("rlgate-demo")
    seed: int = 0
    port: int = 8766
    group_size: int = 6
    groups_per_step: int = 6
    temperature: float = 0.7
    max_tokens: int = 24
    learning_rate: float = 2e-5
    min_gain: float = 0.1  # reward_last - reward_first needed to call the run learned
    max_waves_per_step: int = 4
    # Stop once the run has learned and `patience` versions in a row set no new best
    # mean reward; 0 trains every step.
    patience: int = 3
    run_config: dict[str, Any] = field(default_factory=dict)
    backend: str = "local"  # or a remote kind ("vllm"): the demo starts its server
    server_port: int = 8767  # remote backends: the server's loopback port
    server_max_model_len: int = 2048
    # Held-out evaluation at version 0, whenever the version moves by this much, and at the
    # final version (greedy, `max_tokens`); 0 never evaluates. Each evaluation is one batch
    # of the few held-out problems, so this default keeps it to a few percent of the wall time.
    eval_every: int = 3


@dataclass
class Wave:
    rewards: list[float]
    tokens: int
    seconds: float


async def _agent(client: openai.AsyncOpenAI, cfg: DemoConfig, problem, model: str, seed: int):
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": problem.prompt}],
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens,
        seed=seed,
    )


async def post_rewards(url: str, run: dict[str, Any], rewards: list[dict[str, Any]]) -> None:
    """Rewards in one `POST /v1/rewards` (a list is stored all or nothing)."""
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {run['api_key']}"}, timeout=60
    ) as http:
        (await http.post("/v1/rewards", json=rewards)).raise_for_status()


async def run_wave(
    url: str, run: dict[str, Any], cfg: DemoConfig, rng: random.Random, ids: random.Random
) -> Wave:
    """One wave of groups; every agent is a plain openai.AsyncOpenAI on a path-scoped base_url,
    sampling with its own `seed`, drawn from `rng`. Group and episode ids come from `ids`."""
    t0 = time.perf_counter()
    calls, problems = [], []
    clients = []
    for _ in range(cfg.groups_per_step):
        problem = make_problem(rng)
        group = f"g-{ids.getrandbits(48):012x}"
        for _ in range(cfg.group_size):
            episode = f"e-{ids.getrandbits(48):012x}"
            client = openai.AsyncOpenAI(
                base_url=f"{url}/groups/{group}/episodes/{episode}/v1",
                api_key=run["api_key"],
                max_retries=2,
                timeout=600,
            )
            clients.append(client)
            problems.append(problem)
            # Each agent's own seed, drawn from the demo's: a row's tokens depend on its
            # seed alone, never on its batch-mates, so a seed replays the same replies.
            calls.append(_agent(client, cfg, problem, run["name"], rng.randrange(2**31)))
    responses = await asyncio.gather(*calls)
    rewards = [
        score(p, r.choices[0].message.content or "")
        for p, r in zip(problems, responses, strict=True)
    ]
    await post_rewards(
        url,
        run,
        [
            {"completion_id": resp.id, "reward": reward, "idempotency_key": resp.id}
            for resp, reward in zip(responses, rewards, strict=True)
        ],
    )
    for c in clients:
        await c.close()
    tokens = sum(r.usage.completion_tokens for r in responses)
    return Wave(rewards, tokens, time.perf_counter() - t0)


def _versions(resp: Any) -> set[int]:
    """The versions that sampled a reply's tokens: rlgate's `policy_version` and, when a swap
    came mid-reply, `version_starts` (both in the openai SDK's `model_extra`)."""
    extra = resp.model_extra or {}
    return {v for _, v in extra.get("version_starts") or [[0, extra["policy_version"]]]}


async def evaluate(
    url: str, run: dict[str, Any], cfg: DemoConfig, admin: httpx.AsyncClient
) -> list[dict[str, Any]]:
    """The held-out set once through the run's `/eval` base_url; the gateway's figures
    (`GET /admin/v1/runs/{id}/evals`) for the version that served it.

    Each problem is an evaluation episode, named by its path-scoped base_url
    (`/eval/episodes/{id}/v1`), answered greedily so that a version's figure
    does not depend on sampling luck, scored by the training reward, and
    rewarded through `POST /v1/rewards` like any episode. The demo evaluates a
    version once, beside a training wave of the same version: that wave's
    rewards can enqueue a step only once all its replies are in, and the swap
    comes a train step later, so that version's row is this evaluation's; a
    reply that spanned a swap would count apart, in no row.
    """
    tag = uuid.uuid4().hex[:8]

    async def attempt(i: int, problem: Problem) -> tuple[str, float, set[int]]:
        episode = f"eval-{tag}-{i}"
        async with openai.AsyncOpenAI(
            base_url=f"{url}/eval/episodes/{episode}/v1",
            api_key=run["api_key"],
            max_retries=2,
            timeout=600,
        ) as client:
            resp = await client.chat.completions.create(
                model=run["name"],
                messages=[{"role": "user", "content": problem.prompt}],
                temperature=0.0,
                max_tokens=cfg.max_tokens,
            )
        return episode, score(problem, resp.choices[0].message.content or ""), _versions(resp)

    results = await asyncio.gather(*(attempt(i, p) for i, p in enumerate(heldout_problems())))
    await post_rewards(
        url,
        run,
        [
            {"episode_id": episode, "reward": reward, "idempotency_key": episode}
            for episode, reward, _ in results
        ],
    )
    served = {v for _, _, versions in results if len(versions) == 1 for v in versions}
    r = await admin.get(f"/admin/v1/runs/{run['run_id']}/evals")
    r.raise_for_status()
    return [row for row in r.json()["data"] if row["version"] in served]


async def _evaluate_and_report(
    url: str,
    run: dict[str, Any],
    cfg: DemoConfig,
    admin: httpx.AsyncClient,
    evals: list[dict[str, Any]],
) -> None:
    t0 = time.perf_counter()
    rows = await evaluate(url, run, cfg, admin)
    seconds = time.perf_counter() - t0
    for row in rows:
        evals.append(row)
        spread = f" ± {row['stderr']:.3f}" if row["stderr"] is not None else ""
        print(
            f"held-out v{row['version']}: reward {row['mean_reward']:.3f}{spread} over "
            f"{row['episodes']} problems never trained on (greedy, {seconds:.1f} s)",
            flush=True,
        )


def plateaued(rewards: list[float], min_gain: float, patience: int) -> bool:
    """Whether the run has learned (`summarize`'s rule on the versions so far) and then
    `patience` versions in a row set no new best mean reward."""
    if patience < 1 or len(rewards) <= patience:
        return False
    k = max(1, len(rewards) // 4)
    learned = statistics.fmean(rewards[-k:]) - statistics.fmean(rewards[:k]) >= min_gain
    return learned and max(rewards[-patience:]) <= max(rewards[:-patience])


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


async def _wait_for_version(admin: httpx.AsyncClient, run_id: str, version: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = (await admin.get(f"/admin/v1/runs/{run_id}")).json()
        if (info.get("served_version") or 0) >= version:
            return info
        await asyncio.sleep(0.5)
    raise TimeoutError(f"version {version} was not served within {timeout:.0f}s")


async def _step_queued(admin: httpx.AsyncClient, run_id: str, step: int) -> dict | None:
    steps = (await admin.get(f"/admin/v1/runs/{run_id}/steps")).json()
    return next((s for s in steps if s["step"] == step and s["status"] != StepStatus.FAILED), None)


async def _loop(
    url: str, admin_key: str, cfg: DemoConfig, replicas: list[str] | None = None
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    # Ids drawn from the seed too: groups whose first replies were stored in the same
    # batch tie on time, and the batch policy then takes them in id order.
    ids = random.Random(f"ids-{cfg.seed}")
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as admin:
        run_cfg = {
            "group_size": cfg.group_size,
            "groups_per_step": cfg.groups_per_step,
            "micro_batch_size": min(8, cfg.group_size * cfg.groups_per_step),
            # A step waits for groups whose rewards differ; a wave that leaves too few runs
            # another, and max_waves_per_step of them without enough means converged.
            # max_staleness keeps its default (1): groups of a wave the step did not take
            # train in the next one. At 0 they would be dropped, and admission's capacity
            # (one step's groups) would hold a second wave that this loop rewards only
            # once the whole wave is answered.
            "zero_variance_groups": "skip",
            "learning_rate": cfg.learning_rate,
            "seed": cfg.seed,
            **cfg.run_config,
        }
        body = {"name": "demo", "model": cfg.model, "config": run_cfg, "backend": cfg.backend}
        if replicas:
            body["replicas"] = replicas
        r = await admin.post("/admin/v1/runs", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"could not create the run: {r.text}")
        run = r.json()
        steps: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        evaluated: set[int] = set()  # versions whose held-out set has run

        async def wave_for(version: int, final: bool = False) -> Wave:
            """A wave sampled by `version`, with that version's held-out evaluation beside
            it when one is due: both sample from the same version, so the backend batches
            them together instead of running the evaluation on its own."""
            due = final or version % cfg.eval_every == 0 if cfg.eval_every else False
            if not due or version in evaluated:
                return await run_wave(url, run, cfg, rng, ids)
            evaluated.add(version)
            wave, _ = await asyncio.gather(
                run_wave(url, run, cfg, rng, ids), _evaluate_and_report(url, run, cfg, admin, evals)
            )
            return wave

        converged = False
        for step in range(cfg.steps):
            rewards, tokens, gen_s = [], 0, 0.0
            for _ in range(cfg.max_waves_per_step):
                wave = await wave_for(step)
                rewards += wave.rewards
                tokens += wave.tokens
                gen_s += wave.seconds
                await asyncio.sleep(0.2)
                if await _step_queued(admin, run["run_id"], step):
                    break
            else:
                # Every group of several waves had equal rewards: GRPO has no signal left.
                print(
                    f"converged at version {step}: {cfg.max_waves_per_step} waves gave too few "
                    f"groups with differing rewards (mean reward {statistics.fmean(rewards):.3f})"
                )
                converged = True
                break
            await _wait_for_version(admin, run["run_id"], step + 1, timeout=1800)
            info = await _step_queued(admin, run["run_id"], step)
            entry = {
                "step": step,
                "version": step,
                "trained": True,
                "reward_mean": statistics.fmean(rewards),
                "samples": len(rewards),
                "loss": info.get("loss"),
                "generate_tokens_per_s": tokens / gen_s if gen_s else 0.0,
                "train_tokens_per_s": (info.get("metrics") or {}).get("tokens_per_s"),
                "train_seconds": info.get("duration_s"),
            }
            steps.append(entry)
            print(
                f"{_bar(step + 1, cfg.steps)} step {step:3d} | sampled by v{step:<3d} | "
                f"reward {entry['reward_mean']:.3f} | "
                f"gen {entry['generate_tokens_per_s']:.0f} tok/s "
                f"| train {entry['train_tokens_per_s'] or 0:.0f} tok/s | loss {entry['loss']:+.4f}",
                flush=True,
            )
            if plateaued([s["reward_mean"] for s in steps], cfg.min_gain, cfg.patience):
                print(
                    f"learned; no new best reward in {cfg.patience} versions: "
                    f"stopping after {step + 1} steps (--patience 0 trains every step)"
                )
                break
        final_version = len(steps)
        if converged:  # the last waves measured the final version; evaluate it alone
            if cfg.eval_every and final_version not in evaluated:
                await _evaluate_and_report(url, run, cfg, admin, evals)
        else:  # measure the last version too, its evaluation beside the wave
            final = await wave_for(final_version, final=True)
            rewards = final.rewards
        steps.append(
            {
                "step": final_version,
                "version": final_version,
                "trained": False,
                "reward_mean": statistics.fmean(rewards),
                "samples": len(rewards),
            }
        )
        return {"run_id": run["run_id"], "steps": steps, "converged": converged, "eval": evals}


def summarize(cfg: DemoConfig, steps: list[dict[str, Any]]) -> dict:
    """First vs last: mean reward of the first and last quarter of the measured versions.

    `steps` has one entry per policy version that sampled, the last one
    (never trained on) measuring the final version.
    """
    k = max(1, len(steps) // 4)
    first = statistics.fmean(s["reward_mean"] for s in steps[:k])
    last = statistics.fmean(s["reward_mean"] for s in steps[-k:])
    if len(steps) < 2:
        # No train step ran: the first waves had no reward variance (a random model that
        # never earns a reward, say). Nothing was learned; say so instead of crashing.
        last = first
    return {
        "model": cfg.model,
        "seed": cfg.seed,
        "reward_first": first,
        "reward_last": last,
        "reward_final_version": steps[-1]["reward_mean"],
        "window": k,
        "learned": last - first >= cfg.min_gain,
        "min_gain": cfg.min_gain,
        "steps": steps,
    }


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = summary["steps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [s["step"] for s in steps],
        [s["reward_mean"] for s in steps],
        marker="o",
        label="training waves",
    )
    if summary.get("eval"):
        held = summary["eval"]
        ax.plot(
            [e["version"] for e in held],
            [e["mean_reward"] for e in held],
            marker="s",
            ls="--",
            color="tab:orange",
            label="held-out (greedy)",
        )
    ax.axhline(summary["reward_first"], color="grey", ls=":", label="first steps")
    ax.axhline(summary["reward_last"], color="green", ls="--", label="last steps")
    ax.set_xlabel("train step (policy version that sampled)")
    ax.set_ylabel("mean reward")
    ax.set_title(f"rlgate demo: {summary['model']}, seed {summary['seed']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def _inference_server(cfg: DemoConfig, settings: Settings) -> Iterator[str]:
    """The same server `rlgate inference serve --backend KIND` starts; yields its URL."""
    from inference import registry
    from inference.launch import ServerConfig, running_server
    from inference.models import resolve_model
    from rlgate.inference_cli import server_python

    model_dir = resolve_model(cfg.model, settings.models_dir)
    context = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    server = ServerConfig(
        kind=cfg.backend,
        model_dir=model_dir,
        python=server_python(cfg.backend, None, settings),
        port=cfg.server_port,
        max_model_len=min(cfg.server_max_model_len, int(context or cfg.server_max_model_len)),
        api_key=settings.inference_api_key,
    )
    label = registry.get(cfg.backend).title
    print(f"starting {label} at {server.url} (about 30-100 s) ...", flush=True)
    (cfg.out / "logs").mkdir(parents=True, exist_ok=True)
    with running_server(server, cfg.out / "logs" / f"{cfg.backend}.log", timeout_s=900):
        yield server.url


def run_demo(cfg: DemoConfig, base: Settings) -> int:
    """Returns the process exit code: 0 only if the run learned."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    state = cfg.out / "state"
    # The demo samples a wave, then trains, then samples again: the backend and the worker
    # never run at once, so each may use every core unless the caller set a budget.
    cores = available_cores()
    budget_set = base.backend_threads or base.trainer_threads
    threads = {} if budget_set else {"backend_threads": cores, "trainer_threads": cores}
    settings = base.model_copy(
        update={
            **threads,
            "data_dir": state,
            "database_url": "",
            "broker_url": "",
            "result_backend": "",
            "model_cache_dir": base.models_dir.resolve(),
            "admin_key": base.admin_key or "demo-" + uuid.uuid4().hex,
            "dev_mode": True,
        }
    )
    t0 = time.perf_counter()
    print(f"rlgate demo: model={cfg.model} steps={cfg.steps} seed={cfg.seed} out={cfg.out}")

    from inference import registry
    from inference.models import resolve_model

    print("preparing the model (SmolLM2 is converted once, about 10 s) ...", flush=True)
    # The conversion runs while the gateway and the worker start: neither needs the model
    # before the run is created. An inference server loads it as it starts, so waits for it.
    with ThreadPoolExecutor(1) as convert, contextlib.ExitStack() as stack:
        model = convert.submit(resolve_model, cfg.model, settings.models_dir)
        replicas = None
        if registry.get(cfg.backend).remote:
            model.result()
            replicas = [stack.enter_context(_inference_server(cfg, settings))]
        print("starting the gateway and a Celery worker ...", flush=True)
        url = stack.enter_context(embedded_stack(settings, "127.0.0.1", cfg.port, cfg.out / "logs"))
        model.result()  # converted before the run that serves it is created
        result = asyncio.run(_loop(url, settings.admin_key, cfg, replicas))
    summary = summarize(cfg, result["steps"])
    summary["run_id"] = result["run_id"]
    summary["converged_early"] = result["converged"]
    summary["eval"] = result["eval"]
    summary["wall_seconds"] = time.perf_counter() - t0
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(summary, cfg.out / "reward.png")
    verdict = "learned" if summary["learned"] else "did NOT learn"
    print(
        f"reward first {summary['window']} steps {summary['reward_first']:.3f} -> "
        f"last {summary['window']} steps {summary['reward_last']:.3f} "
        f"(final version {summary['reward_final_version']:.3f}): {verdict} "
        f"in {summary['wall_seconds']:.0f}s; wrote {cfg.out / 'summary.json'} and reward.png",
        file=sys.stdout,
    )
    return 0 if summary["learned"] else 1
