"""`rlgate bench learn`: held-out reward gained from one budget of samples, rlgate against TRL.

Same model, task (`rlgate/learn_task.py`), budget of sampled completions and
hyperparameters on both sides, one after the other on the same machine:

* **TRL**: `GRPOTrainer` on CPU in its own venv (`~/.cache/rlgate/trl-venv`,
  made on first use: trl and torch pinned, torch CPU from /opt/wheels when
  that directory exists), run by `rlgate/bench/learn_trl.py`;
* **rlgate**: the embedded stack and an online agent written with the plain
  `openai` SDK (`rlgate/bench/learn_rlgate.py`), rlgate's defaults otherwise.

The base model and both final policies are then sampled on the held-out
problems (never trained on) with the same settings and one fixed seed, with
plain transformers. Wall-clock: TRL from `train()` to its return; rlgate from
the agent's first request to the last sample (spend) and to the end of the
last train step (finish); model loading before either is not counted.

The last line is JSON: `reward_ratio` (rlgate held-out gain / TRL's),
`wall_ratio` (rlgate finish / TRL), `trained_fraction` (rlgate completions
that trained, over those sampled outside zero-variance groups), the means over
`--seeds`, and each seed's figures. `learn.png` plots both sides' training
reward against completions sampled and against wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rlgate.learn_task import messages, score, split

TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
TRL_VENV = Path.home() / ".cache" / "rlgate" / "trl-venv"
LOCAL_WHEELS = Path("/opt/wheels")
EVAL_SEED = 1234


@dataclass
class LearnConfig:
    """The shared hyperparameters (printed at the top) and where things go."""

    model: str = "smollm2"
    budget: int = 640  # sampled completions per side
    seed: int = 0
    learning_rate: float = 1e-5  # rlgate's default
    clip: float = 0.2  # rlgate's default clip_eps_low/high, TRL's epsilon/epsilon_high
    group_size: int = 4
    completions_per_step: int = 16
    micro_batch: int = 8  # rlgate's default micro_batch_size; TRL's per-device batch
    max_tokens: int = 16
    temperature: float = 1.0
    groups_in_flight: int = 4  # rlgate's agent only: TRL samples one step's groups at a time
    eval_samples: int = 8  # per held-out problem
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "rlgate")
    port: int = 0

    def __post_init__(self) -> None:
        if self.completions_per_step % self.group_size:
            raise ValueError("--completions-per-step must be a multiple of the group size")
        if self.completions_per_step % self.micro_batch:
            raise ValueError("--micro-batch must divide the completions per step")
        if self.budget < self.completions_per_step or self.budget % self.completions_per_step:
            raise ValueError(f"--budget must be a multiple of {self.completions_per_step}")

    def shared(self) -> dict[str, Any]:
        keys: tuple[str, ...] = (
            "model",
            "budget",
            "learning_rate",
            "clip",
            "group_size",
            "completions_per_step",
        )
        keys += ("micro_batch", "max_tokens", "temperature", "groups_in_flight", "eval_samples")
        return {k: getattr(self, k) for k in keys} | {"beta": 0.0, "eval_seed": EVAL_SEED}


def trl_python(venv: Path = TRL_VENV) -> Path:
    """TRL's venv python, created on first use (trl and CPU torch pinned; no model download)."""
    python = venv / "bin" / "python"
    marker = venv / f".rlgate-trl-{TRL_VERSION}-torch-{TORCH_VERSION}"
    if not marker.exists():
        print(f"installing trl=={TRL_VERSION} into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"]
        pip.append(f"torch=={TORCH_VERSION}")
        if LOCAL_WHEELS.is_dir():  # the CPU build; PyPI's default torch is a multi-GB CUDA one
            pip += ["--find-links", str(LOCAL_WHEELS)]
        subprocess.run(pip, check=True)
        marker.touch()
    return python


def trl_script() -> Path:
    """The script TRL's side runs in its own virtual environment (`learn_trl.py`, beside this)."""
    return Path(__file__).with_name("learn_trl.py")


def run_trl(cfg: LearnConfig, model_dir: Path, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    spec = asdict(cfg) | {
        "cache_dir": str(cfg.cache_dir),
        "model_dir": str(model_dir),
        "out_dir": str(out),
        "task_module": str(Path(__file__).parents[1] / "learn_task.py"),
    }
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    script = trl_script()
    with (out / "trl.log").open("wb") as log:
        proc = subprocess.run(
            [str(trl_python()), str(script), str(out / "spec.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if proc.returncode:
        tail = (out / "trl.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"TRL's side failed ({proc.returncode}); trl.log ends:\n{tail}")
    return json.loads((out / "result.json").read_text())


def evaluate(model_dir: Path, tokenizer_dir: Path, cfg: LearnConfig) -> float:
    """Mean reward on the held-out problems: `eval_samples` each, at the training settings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problems = split("heldout")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [
        tok.apply_chat_template(messages(p), add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(EVAL_SEED)
    with torch.no_grad():
        ids = model.generate(
            **enc,
            do_sample=True,
            temperature=cfg.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.max_tokens,
            num_return_sequences=cfg.eval_samples,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    replies = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    k = cfg.eval_samples
    return statistics.fmean(score(problems[i // k], r) for i, r in enumerate(replies))


def _trl_figures(result: dict[str, Any], per_step: int) -> dict[str, Any]:
    points = result["points"]
    return {
        "steps": result["steps"],
        "sampled": result["completions"],
        "spend_s": result["train_s"],
        "finish_s": result["train_s"],
        # every sampled completion is in a step; only zero-variance groups have zero advantage
        "trained_fraction": 1.0,
        "staleness_mean": 0.0,
        "clip_frac": statistics.fmean(p["clip_frac"] for p in points) if points else 0.0,
        "dropped": {},
        "curve": [(per_step * p["step"], p["t"], p["reward"]) for p in points],
    }


def _rlgate_curve(side: dict[str, Any], per_step: int) -> list[tuple[int, float, float]]:
    """Mean reward of each `per_step` completions, in the order they were sampled."""
    s = side["samples"]
    chunks = [s[i : i + per_step] for i in range(0, len(s) - per_step + 1, per_step)]
    return [
        (per_step * (n + 1), c[-1].t, statistics.fmean(x.reward for x in c))
        for n, c in enumerate(chunks)
    ]


def one_seed(cfg: LearnConfig, model_dir: Path, base_reward: float, out: Path) -> dict[str, Any]:
    from core.settings import Settings
    from rlgate.bench.learn_stack import run_rlgate, trained_figures

    print(f"seed {cfg.seed}: TRL GRPOTrainer ...", flush=True)
    trl = _trl_figures(run_trl(cfg, model_dir, out / "trl"), cfg.completions_per_step)
    trl["heldout"] = evaluate(out / "trl" / "final", model_dir, cfg)
    print(f"seed {cfg.seed}: rlgate (embedded stack, openai agent) ...", flush=True)
    side = run_rlgate(cfg, out / "rlgate", Settings())
    samples = [asdict(s) for s in side["samples"]]  # for a later look: time, reward, group
    (out / "rlgate" / "samples.json").write_text(json.dumps(samples))
    rl = trained_figures(side, cfg.group_size) | {
        "spend_s": side["spend_s"],
        "finish_s": side["finish_s"],
        "curve": _rlgate_curve(side, cfg.completions_per_step),
    }
    rl["heldout"] = evaluate(Path(side["final_dir"]), model_dir, cfg)
    return seed_summary(cfg.seed, base_reward, trl, rl)


def seed_summary(
    seed: int, base_reward: float, trl: dict[str, Any], rl: dict[str, Any]
) -> dict[str, Any]:
    """One seed's figures from both sides' (`heldout`, `finish_s`, `trained_fraction`, ...)."""
    trl_gain, rl_gain = trl["heldout"] - base_reward, rl["heldout"] - base_reward
    return {
        "seed": seed,
        "base": base_reward,
        "trl": trl,
        "rlgate": rl,
        "trl_gain": trl_gain,
        "rlgate_gain": rl_gain,
        "reward_ratio": rl_gain / trl_gain if trl_gain > 0 else None,
        "wall_ratio": rl["finish_s"] / trl["finish_s"],
        "trained_fraction": rl["trained_fraction"],
    }


def _print_seed(r: dict[str, Any]) -> None:
    t, g = r["trl"], r["rlgate"]
    rows = [
        ("held-out reward", f"{r['base']:.3f}", f"{t['heldout']:.3f}", f"{g['heldout']:.3f}"),
        ("held-out gain", "", f"{r['trl_gain']:+.3f}", f"{r['rlgate_gain']:+.3f}"),
        ("wall s: spend budget", "", f"{t['spend_s']:.1f}", f"{g['spend_s']:.1f}"),
        ("wall s: finish training", "", f"{t['finish_s']:.1f}", f"{g['finish_s']:.1f}"),
        ("optimizer steps", "", str(t["steps"]), str(g["steps"])),
        ("completions sampled", "", str(t["sampled"]), str(g["sampled"])),
        ("trained fraction", "", f"{t['trained_fraction']:.2f}", f"{g['trained_fraction']:.2f}"),
        ("staleness mean", "", f"{t['staleness_mean']:.2f}", f"{g['staleness_mean']:.2f}"),
        ("clip fraction", "", f"{t['clip_frac']:.4f}", f"{g['clip_frac']:.4f}"),
    ]
    print(f"\nseed {r['seed']}{'':17} {'base':>8} {'TRL':>8} {'rlgate':>8}")
    for name, *cells in rows:
        print(f"{name:<24} " + " ".join(f"{c:>8}" for c in cells))
    dropped = ", ".join(f"{k} {v}" for k, v in g["dropped"].items() if v) or "none"
    print(f"rlgate dropped: {dropped}; zero-variance completions {g['zero_variance_completions']}")
    ratio = "n/a (TRL gained nothing)" if r["reward_ratio"] is None else f"{r['reward_ratio']:.2f}"
    print(f"reward_ratio {ratio}, wall_ratio {r['wall_ratio']:.2f}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in results:
        for side, color in (("trl", "tab:orange"), ("rlgate", "tab:blue")):
            curve = r[side]["curve"]
            label = f"{'TRL' if side == 'trl' else 'rlgate'} seed {r['seed']}"
            for ax, x in zip(axes, (0, 1), strict=True):
                ax.plot([c[x] for c in curve], [c[2] for c in curve], color=color, label=label)
                end = (curve[-1][0] if curve else 0, r[side]["finish_s"])[x]
                ax.plot([end], [r[side]["heldout"]], marker="*", color=color, ms=12)
        for ax in axes:
            ax.plot([0], [r["base"]], marker="o", color="grey")
    axes[0].set_xlabel("completions sampled")
    axes[1].set_xlabel("wall-clock s")
    axes[0].set_ylabel("reward per 16 completions sampled")
    axes[1].set_title("* held-out after training (at finish), o base model", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("rlgate bench learn")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _without_curves(r: dict[str, Any]) -> dict[str, Any]:
    sides = ("trl", "rlgate")
    out = {k: v for k, v in r.items() if k not in sides}
    return out | {s: {k: v for k, v in r[s].items() if k != "curve"} for s in sides}


def bench_learn(cfg: LearnConfig, seeds: list[int], out: Path) -> dict[str, Any]:
    from inference.models import resolve_model

    print("rlgate bench learn: " + json.dumps(cfg.shared() | {"seeds": seeds}), flush=True)
    model_dir = resolve_model(cfg.model, cfg.cache_dir)
    trl_python()  # install before any clock starts
    base = evaluate(model_dir, model_dir, cfg)
    print(f"base model held-out reward {base:.3f}", flush=True)
    results = []
    for seed in seeds:
        seed_cfg = LearnConfig(**(asdict(cfg) | {"seed": seed}))
        results.append(one_seed(seed_cfg, model_dir, base, out / f"seed{seed}"))
        _print_seed(results[-1])
    plot(results, out / "learn.png")
    result = summary(results, base, out)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def summary(results: list[dict[str, Any]], base: float, out: Path) -> dict[str, Any]:
    """The bench's JSON: the seeds' means (`reward_ratio` only if TRL gained on every seed)."""
    ratios = [r["reward_ratio"] for r in results if r["reward_ratio"] is not None]
    return {
        "bench": "learn",
        "reward_ratio": statistics.fmean(ratios) if len(ratios) == len(results) else None,
        "wall_ratio": statistics.fmean(r["wall_ratio"] for r in results),
        "trained_fraction": statistics.fmean(r["trained_fraction"] for r in results),
        "base_heldout": base,
        "seeds": [_without_curves(r) for r in results],
        "out": str(out),
    }


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options named after `LearnConfig` fields (`--lr` sets `learning_rate`)."""
    d = LearnConfig()
    p.add_argument("--model", default=d.model, help="smollm2, tiny or a local HF directory")
    p.add_argument("--budget", type=int, default=d.budget, help="sampled completions per side")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1")
    p.add_argument("--lr", dest="learning_rate", type=float, default=d.learning_rate)
    p.add_argument("--clip", type=float, default=d.clip, help="PPO clip range, both sides")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples, help="per held-out prompt")
    p.add_argument("--out", type=Path, default=None, help="default: a fresh temporary directory")
    p.add_argument("--cache-dir", type=Path, default=d.cache_dir, help="converted models")
    return p


def run(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(LearnConfig)}
    cfg = LearnConfig(**{k: v for k, v in vars(args).items() if k in names})
    out = args.out or Path(tempfile.mkdtemp(prefix="rlgate-bench-learn-"))
    out.mkdir(parents=True, exist_ok=True)
    result = bench_learn(cfg, [int(s) for s in args.seeds.split(",")], out.resolve())
    print(f"wrote {out / 'learn.png'} and {out / 'summary.json'}")
    print(json.dumps(result))
    return 0
