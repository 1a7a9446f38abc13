"""`rlgate bench train`'s `step_ratio`: a train step through the worker against a bare loop.

The worker side is the real code path of a train step: a SQLite store holding
a run with 16 rewarded completions per step (4 groups of 4 episodes, one
completion each, prompt and output lengths of a short chat task; a group's
episodes answer one prompt, as GRPO's do), and
`trainer.tasks.Trainer.train_step`, which reads the step's episodes, builds
the token-exact samples and advantages, runs `LocalEngine.step`, writes the
checkpoint of version N+1 and commits the version bump. Steps after the first
find the engine warm (model and AdamW resident), as a worker does.

The baseline is what a user would write by hand: the same samples (read once
from the store the way the worker reads them), the same model directory,
float32, AdamW with the run's learning rate and weight decay, the run's
micro-batch size, a clipped PPO loss over full-sequence logits, gradient
clipping, one optimizer step, and no checkpoint. Both run in this process on
the same torch thread count, interleaved step by step; the first step of each
(loading and warm-up) is reported apart and the median of the rest is compared.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlgate.seed_rows import RUN_ID, StepShape, seed_store

if TYPE_CHECKING:  # torch is imported only when the bench runs
    from trainer.batch import Sample
    from trainer.config import RunConfig


class BareLoop:
    """A hand-written forward/backward/AdamW step over the same samples, nothing else."""

    def __init__(self, model_dir: Path, cfg: RunConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )

    def step(self, samples: list[Sample]) -> float:
        import torch

        from trainer.batch import collate

        cfg = self.cfg
        n_tokens = max(1, sum(sum(s.loss_mask[1:]) for s in samples))
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(samples), cfg.micro_batch):
            b = collate(samples[i : i + cfg.micro_batch], self.pad_id)
            logits = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            logp = torch.log_softmax(logits[:, :-1] / b.temperatures[:, 1:, None], dim=-1)
            logp = logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp((logp - b.old_logprobs[:, 1:]).clamp(-20, 20))
            adv = b.advantages[:, 1:]
            clipped = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
            pg = -torch.minimum(ratio * adv, clipped * adv)
            loss = (pg * b.loss_mask[:, 1:]).sum() / n_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        return total


def bench_step_ratio(model_dir: Path, work: Path, threads: int, repeats: int) -> dict[str, Any]:
    """Seconds of a warm worker step and of a bare step (medians of `repeats`) and their ratio."""
    import torch
    from sqlalchemy.orm import sessionmaker

    from core.settings import Settings
    from core.store.db import make_sync_engine
    from core.store.models import TrainStep
    from trainer.batch import load_step_samples
    from trainer.config import RunConfig
    from trainer.tasks import Trainer

    torch.set_num_threads(threads)
    shape = StepShape()
    cfg = RunConfig(group_size=shape.group_size, groups_per_step=shape.groups)
    settings = Settings(data_dir=work / "data", trainer_threads=threads, dev_mode=True)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    seed_store(url, model_dir, cfg, repeats + 1, shape)
    db = make_sync_engine(url)
    with sessionmaker(db)() as s:
        samples, *_ = load_step_samples(s, RUN_ID, 0, cfg)
    db.dispose()

    trainer = Trainer(settings)
    bare = BareLoop(model_dir, cfg)
    worker_s: list[float] = []
    engine_s: list[float] = []
    bare_s: list[float] = []
    for step in range(repeats + 1):  # interleaved, so drift on the machine hits both alike
        t0 = time.perf_counter()
        trainer.train_step(RUN_ID, step)
        worker_s.append(time.perf_counter() - t0)
        with trainer.sessions() as s:
            engine_s.append(float(s.get_one(TrainStep, (RUN_ID, step)).metrics["train_seconds"]))
        t0 = time.perf_counter()
        bare.step(samples)
        bare_s.append(time.perf_counter() - t0)
    trainer.sessions.kw["bind"].dispose()

    tokens = sum(len(s.input_ids) for s in samples)
    shape_figures = {"step_completions": shape.completions, "step_tokens": tokens}
    threads_used = {"step_threads": torch.get_num_threads()}
    result = step_figures(worker_s, engine_s, bare_s, shape_figures | threads_used)
    worker, engine = result["worker_step_s"], result["worker_engine_s"]
    print(
        f"step ({shape.completions} completions, {tokens} tokens, float32, "
        f"{torch.get_num_threads()} torch threads, median of {repeats} warm steps):"
    )
    print(
        f"  worker: {worker:.3f} s (engine step {engine:.3f} s, store + checkpoint "
        f"{worker - engine:.3f} s; first step {worker_s[0]:.2f} s with loading)"
    )
    print(f"  bare transformers loop: {result['bare_step_s']:.3f} s (first step {bare_s[0]:.2f} s)")
    print(f"  step_ratio: {result['step_ratio']:.2f}")
    return result


def step_figures(
    worker_s: list[float], engine_s: list[float], bare_s: list[float], shape: dict[str, Any]
) -> dict[str, Any]:
    """The `step_ratio` part of the bench's JSON from each step's seconds (the first is warm-up)."""
    worker, bare = statistics.median(worker_s[1:]), statistics.median(bare_s[1:])
    return shape | {
        "worker_step_s": worker,
        "worker_engine_s": statistics.median(engine_s[1:]),
        "bare_step_s": bare,
        "step_ratio": worker / bare,
    }
