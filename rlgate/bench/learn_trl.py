"""TRL's side of `rlgate bench learn`: `GRPOTrainer` on CPU, run inside TRL's own venv.

`rlgate/bench/learn.py` starts this file with the venv's python and one
argument, a JSON spec (model directory, task module path, hyperparameters,
output directory). It imports only what that venv has (trl, transformers,
torch, datasets) plus the task module, imported from rlgate's folder alone (see
`load_task`), so both sides score with the same code.

The trainer is set up to match rlgate's defaults step for step: float32,
beta 0 (no reference model), `num_generations` = the group size, one
optimizer step per `completions_per_step` completions (micro-batches of
`micro_batch` completions, gradient accumulation for the rest), one PPO
iteration per batch, the same clip range on both sides, token-mean loss
over the whole step (TRL's `dapo`, rlgate's `token_mean`), group-std
advantages, constant learning rate, gradient norm clipped at 1. Prompts
come in the task's seeded training order, the order rlgate's agent uses.

Writes `result.json` (per-step reward and clip fraction against wall-clock)
and the final policy to `final/` in the output directory.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def load_task(path: str) -> ModuleType:
    """The task module from rlgate's folder, without importing the rest of rlgate.

    A bare `rlgate` package pointing at that folder stands in for the real one,
    so the task's own imports (`rlgate.demo_task`) resolve there and nothing
    else of rlgate, nor any of its dependencies, is loaded into this venv.
    """
    task = Path(path)
    if "rlgate" not in sys.modules:
        package = ModuleType("rlgate")
        package.__path__ = [str(task.parent)]
        sys.modules["rlgate"] = package
    return importlib.import_module(f"rlgate.{task.stem}")


def train(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = load_task(spec["task_module"])
    out = Path(spec["out_dir"])
    order = task.train_order(spec["seed"])
    names = list(task.fields(order[0]))
    dataset = Dataset.from_list([{"prompt": task.messages(p), **task.fields(p)} for p in order])

    def reward(completions: list, **columns: list) -> list[float]:
        return [
            task.score(task.Problem(**{n: columns[n][i] for n in names}), c[0]["content"])
            for i, c in enumerate(completions)
        ]

    class Timeline(TrainerCallback):
        """Reward and clip fraction of every optimizer step, against seconds since train()."""

        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.points: list[dict[str, Any]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.points.append(
                    {
                        "step": state.global_step,
                        "t": time.perf_counter() - self.t0,
                        "reward": logs["reward"],
                        "clip_frac": logs.get("clip_ratio/region_mean", 0.0),
                        "zero_std_frac": logs.get("frac_reward_zero_std", 0.0),
                    }
                )

    per_step, micro = spec["completions_per_step"], spec["micro_batch"]
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=spec["budget"] // per_step,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        epsilon=spec["clip"],
        epsilon_high=spec["clip"],
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=spec["seed"],
        data_seed=spec["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    timeline = Timeline()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timeline],
    )
    trainer.train()
    train_s = time.perf_counter() - timeline.t0
    trainer.save_model(str(out / "final"))
    import trl

    return {
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "train_s": train_s,
        "steps": trainer.state.global_step,
        "completions": trainer.state.global_step * per_step,
        "points": timeline.points,
        "final_dir": str(out / "final"),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = train(spec)
    Path(spec["out_dir"], "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
