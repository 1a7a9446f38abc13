"""`rlgate bench sample`: generated tokens/s and time to first token of the local backend.

The workload is one demo wave: `agents` chat requests (groups of
`group_size` agents on one addition problem each, the demo's prompt rendered
with the model's own chat template) arrive `gap_ms` apart; each samples at
temperature 1.0 with a seed of its own and `max_tokens` drawn from
`min_tokens`..`max_tokens` (fixed seed), and no stop token, so it generates
exactly its `max_tokens`. Targets, each in a process of its own
(`sample_target`, same model in float32, same torch threads), one after
another, in alternating order over `rounds`:

* ``rlgate``: this tree's `LocalBackend`, each request submitted with
  `start_stream` at its arrival time;
* ``generate``: one bare transformers ``model.generate()`` call on every
  request at once, at time 0 (it waits for no arrival): left-padded,
  sampled, ``max_new_tokens`` the largest ``max_tokens``; only each
  request's own ``max_tokens`` count as generated tokens;
* ``static`` (with ``--baseline-src``): the `LocalBackend` of that source
  tree, the workload of ``rlgate``.

Per target: tokens/s = generated tokens / seconds from the first arrival to
the last token; time to first token per request, from its arrival (for
``generate``, from the call: the first decode step's tokens exist, the
same instant for every row); p50 and p99 over the requests. Several rounds:
each figure is the median of its rounds'.

Roofline: a decode step of `rows` rows reads every weight once and does
2 x params x rows FLOPs, so it takes at least max(weight bytes / bandwidth,
2 x params x rows / FLOP/s), with the bandwidth (a sum over 512 MiB) and the
matmul FLOP/s (2048 x 2048 float32) measured in the same run on the same
threads (best of several; the best round). `params` are the matrices a
token passes through (all weights but the input embedding, whose row is
only looked up); attention over the KV cache and the prefill are left out,
so the bound is generous. The roofline tokens/s at all `agents` rows decoding
together is rows / that step; a target's `roofline_fraction` = its tokens/s
/ the roofline's: 1.0 is the hardware's limit.

The last printed line is JSON (`summary`): `sample_ratio` = rlgate / generate
tokens/s, `static_ratio` = rlgate / static (null without a baseline),
`roofline_fraction` (rlgate's), per target its figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from rlgate.bench import dirs as bench_dirs
from rlgate.cli_args import positive_int

logger = logging.getLogger(__name__)

TARGET_SCRIPT = Path(__file__).with_name("sample_target.py")
THIS_TREE = Path(__file__).resolve().parents[2]
BASELINE = "static"
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "wall_s")


def demo_messages(agents: int, group_size: int, seed: int) -> list[list[dict[str, str]]]:
    """The demo's wave: groups of `group_size` agents, each group on one problem."""
    from rlgate.demo_task import make_problem

    rng = random.Random(seed)
    waves: list[list[dict[str, str]]] = []
    for _ in range(math.ceil(agents / group_size)):
        message = {"role": "user", "content": make_problem(rng).prompt}
        waves += [[message]] * group_size
    return waves[:agents]


def write_spec(path: Path, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The workload every target runs (`sample_target`'s SPEC), written to `path`."""
    from inference.chat_template import ChatTemplate

    template = ChatTemplate(model_dir)
    rng = random.Random(args.seed)
    spec = {
        "model_dir": str(model_dir),
        "threads": args.threads,
        "max_batch_size": args.max_batch_size,
        "gap_s": args.gap_ms / 1000,
        "prompts": [
            template.render(m) for m in demo_messages(args.agents, args.group_size, args.seed)
        ],
        "max_tokens": [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.agents)],
        "seeds": [rng.randrange(2**31) for _ in range(args.agents)],
    }
    path.write_text(json.dumps(spec))
    return spec


def run_target(kind: str, spec: Path, out: Path, src: Path = THIS_TREE) -> dict[str, Any]:
    """`sample_target` `kind` in a fresh process importing `inference` from `src`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    log = out.with_suffix(".log")
    # -P: the script's directory (rlgate/bench) stays off sys.path, so its modules
    # cannot shadow top-level ones
    cmd = [sys.executable, "-P", str(TARGET_SCRIPT), kind, str(spec), str(out)]
    with open(log, "wb") as f:
        code = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"sample target {kind} ({src}) exited {code}:\n{tail}")
    result = json.loads(out.read_text())
    if "source" in result and Path(result["source"]) != src.resolve():
        raise RuntimeError(f"target {kind} imported inference from {result['source']}, not {src}")
    return result


def run_figures(raw: dict[str, Any], arrivals: list[float]) -> dict[str, float]:
    """One run's figures from its timings (seconds from the first arrival)."""
    ttft = [first - at for first, at in zip(raw["first_token_s"], arrivals, strict=True)]
    wall = max(raw["last_token_s"])
    tokens = sum(raw["tokens"])
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) > 1 else ttft * 99
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p99_ms": q[98] * 1e3,
        "wall_s": wall,
        "tokens": tokens,
    }


def target_figures(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """A target's figures: each the median of its rounds'."""
    median = {k: statistics.median(r[k] for r in rounds) for k in FIGURES}
    return median | {"tokens": rounds[0]["tokens"], "rounds": rounds}


def matmul_params(model_dir: Path) -> int:
    """Parameters a decoded token is multiplied through: all but the input embedding (a
    lookup), with a tied output head counted once as the matrix it is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters() if p is not embed)
    head = model.get_output_embeddings()
    if head is not None and head.weight is embed:
        total += embed.numel()
    return total


def roofline(hardware: dict[str, float], params: int, rows: int) -> dict[str, Any]:
    """The shortest decode step of `rows` rows the machine allows (float32 weights)."""
    weight_bytes = 4 * params
    memory_s = weight_bytes / hardware["bandwidth_bytes_per_s"]
    compute_s = 2 * params * rows / hardware["matmul_flop_per_s"]
    step_s = max(memory_s, compute_s)
    return {
        "rows": rows,
        "params": params,
        "weight_bytes": weight_bytes,
        "step_ms": step_s * 1e3,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "tokens_per_s": rows / step_s,
    }


def summary(
    config: dict[str, Any],
    targets: dict[str, dict[str, Any]],
    hardware: dict[str, float],
    params: int,
) -> dict[str, Any]:
    """The bench's JSON: each target's figures and roofline fraction, and the ratios.

    `config`: model, agents, threads and the workload's settings; `targets`:
    `target_figures` of ``rlgate``, ``generate`` and, with a baseline, ``static``.
    """
    bound = roofline(hardware, params, config["agents"])
    per_target = {
        name: figures | {"roofline_fraction": figures["tokens_per_s"] / bound["tokens_per_s"]}
        for name, figures in targets.items()
    }
    rlgate = per_target["rlgate"]["tokens_per_s"]
    static = per_target.get(BASELINE)
    return {
        "bench": "sample",
        **config,
        "hardware": {
            "bandwidth_gb_per_s": hardware["bandwidth_bytes_per_s"] / 1e9,
            "matmul_gflop_per_s": hardware["matmul_flop_per_s"] / 1e9,
        },
        "roofline": bound,
        **per_target,
        "sample_ratio": rlgate / per_target["generate"]["tokens_per_s"],
        "static_ratio": None if static is None else rlgate / static["tokens_per_s"],
        "roofline_fraction": per_target["rlgate"]["roofline_fraction"],
    }


def best_hardware(measured: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(m[k] for m in measured) for k in measured[0]}


def bench_sample(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    """Every target over `args.rounds` rounds, alternating their order; the summary."""
    spec_path = work / "spec.json"
    spec = write_spec(spec_path, model_dir, args)
    arrivals = {
        "rlgate": [spec["gap_s"] * i for i in range(args.agents)],
        "generate": [0.0] * args.agents,
    }
    sources = {"rlgate": ("backend", THIS_TREE), "generate": ("generate", THIS_TREE)}
    if args.baseline_src is not None:
        sources[BASELINE] = ("backend", args.baseline_src.resolve())
        arrivals[BASELINE] = arrivals["rlgate"]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    hardware, threads = [], set()
    for r in range(args.rounds):
        hardware.append(run_target("hardware", spec_path, work / f"hardware-{r}.json"))
        order = list(sources) if r % 2 == 0 else list(reversed(sources))
        for name in order:
            kind, src = sources[name]
            raw = run_target(kind, spec_path, work / f"{name}-{r}.json", src)
            threads.add(raw["torch_threads"])
            runs[name].append(run_figures(raw, arrivals[name]))
            logger.info("round %d %s: %.1f tokens/s", r, name, runs[name][-1]["tokens_per_s"])
    if len(threads) != 1:
        raise RuntimeError(f"the targets ran on different torch thread counts: {threads}")
    config = {
        "model": args.model,
        "agents": args.agents,
        "group_size": args.group_size,
        "gap_ms": args.gap_ms,
        "min_tokens": args.min_tokens,
        "max_tokens": args.max_tokens,
        "max_batch_size": args.max_batch_size,
        "prompt_tokens": [min(map(len, spec["prompts"])), max(map(len, spec["prompts"]))],
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "threads": threads.pop(),
    }
    targets = {name: target_figures(rounds) for name, rounds in runs.items()}
    return summary(config, targets, best_hardware(hardware), matmul_params(model_dir))


def figure_lines(out: dict[str, Any]) -> list[str]:
    """What a reader looks at first: each target's line, then the ratios."""
    bound = out["roofline"]
    lines = [
        f"{out['agents']} agents {out['gap_ms']:g} ms apart, {out['model']}, "
        f"{out['threads']} torch threads on {out['cores']} cores; roofline "
        f"{bound['tokens_per_s']:.0f} tokens/s ({bound['bound']}-bound, "
        f"{out['hardware']['bandwidth_gb_per_s']:.1f} GB/s, "
        f"{out['hardware']['matmul_gflop_per_s']:.0f} GFLOP/s)"
    ]
    for name in ("rlgate", "generate", BASELINE):
        if name in out:
            t = out[name]
            lines.append(
                f"{name:>8}: {t['tokens_per_s']:7.1f} tokens/s, time to first token "
                f"p50 {t['ttft_p50_ms']:.0f} ms p99 {t['ttft_p99_ms']:.0f} ms, "
                f"{t['roofline_fraction']:.1%} of the roofline"
            )
    static = "" if out["static_ratio"] is None else f", rlgate/static {out['static_ratio']:.2f}"
    lines.append(f"rlgate/generate {out['sample_ratio']:.2f}{static}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="smollm2", help="smollm2, tiny or a local HF directory")
    p.add_argument("--agents", type=positive_int, default=36, help="requests in the wave")
    p.add_argument("--group-size", type=positive_int, default=6, help="agents per problem")
    p.add_argument("--gap-ms", type=float, default=50.0, help="between two arrivals")
    p.add_argument("--min-tokens", type=positive_int, default=16)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--seed", type=int, default=0, help="problems, max_tokens and sample seeds")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads of every target (0: torch's)"
    )
    p.add_argument(
        "--max-batch-size", type=positive_int, default=64, help="the backend's (the gateway's)"
    )
    p.add_argument("--rounds", type=positive_int, default=1, help="runs of each target")
    p.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="a source tree of rlgate (git worktree, git archive): its LocalBackend is "
        "measured in the same run as `static`",
    )
    bench_dirs.add_dir_arguments(p, "the workload, each target's timings and logs")
    return p


def run(args: argparse.Namespace) -> int:
    from inference.models import resolve_model

    if args.min_tokens > args.max_tokens:
        print("--min-tokens must not exceed --max-tokens", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model, bench_dirs.model_cache(args.cache_dir))
    with bench_dirs.work_dir("sample", args.work_dir) as work:
        out = bench_sample(args, model_dir, work)
    for line in figure_lines(out):
        print(line)
    print(json.dumps(out))
    return 0
