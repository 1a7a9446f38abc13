"""`rlgate bench train --engine fsdp`: a resident FSDP step against the local engine's.

Both sides are the worker's real code path, `trainer.tasks.Trainer.train_step`,
on the same store and the same batch (`rlgate.bench.train_step.seed_store`,
two runs seeded alike): it reads the step's episodes, builds the samples,
trains, writes the checkpoint of version N+1 and commits the version bump.

- local: `LocalEngine` in this process, `threads` torch threads.
- fsdp: the run's resident torchrun ranks (`trainer.resident_pool`),
  `world_size` ranks of `threads / world_size` threads each (the trainer's
  split), float32 like the local engine.

The sides alternate step by step so that drift on a shared machine hits them
alike; the first step of each (loading, and for FSDP starting the group) is
reported apart, and the medians of the rest are compared.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from rlgate.seed_rows import StepShape, seed_store


def bench_fsdp_step_ratio(
    model_dir: Path,
    work: Path,
    threads: int,
    repeats: int,
    world_size: int,
) -> dict[str, Any]:
    """Seconds of a warm step per side (medians of `repeats`) and the ratios to local."""
    import torch

    from core.settings import Settings
    from trainer.config import RunConfig
    from trainer.tasks import Trainer

    torch.set_num_threads(threads)
    shape = StepShape()
    local_cfg = RunConfig(group_size=shape.group_size, groups_per_step=shape.groups)
    fsdp_cfg = local_cfg.model_copy(update={"engine": "fsdp", "world_size": world_size})
    settings = Settings(data_dir=work / "fsdp", trainer_threads=threads, dev_mode=True)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    sides = {"local": local_cfg, "fsdp": fsdp_cfg}
    for name, cfg in sides.items():
        seed_store(url, model_dir, cfg, repeats + 1, shape, name)
    trainers = {name: Trainer(settings) for name in sides}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for step in range(repeats + 1):
            for name in sides:
                t0 = time.perf_counter()
                trainers[name].train_step(name, step)
                seconds[name].append(time.perf_counter() - t0)
    finally:
        for trainer in trainers.values():
            trainer.close()
            trainer.sessions.kw["bind"].dispose()

    result = fsdp_figures(seconds, world_size, threads)
    print(
        f"fsdp step ({shape.completions} completions, float32, world size {world_size}, "
        f"{threads} torch threads in all, median of {repeats} warm steps, interleaved):"
    )
    for name, label in (("local", "local engine"), ("fsdp", "FSDP, resident ranks")):
        med = statistics.median(seconds[name][1:])
        print(f"  {label}: {med:.3f} s (first step {seconds[name][0]:.2f} s)")
    print(f"  fsdp_step_ratio: {result['fsdp_step_ratio']:.2f}")
    return result


def fsdp_figures(seconds: dict[str, list[float]], world_size: int, threads: int) -> dict[str, Any]:
    """The `fsdp_step_ratio` part of the bench's JSON from each side's step seconds."""
    med = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    return {
        "fsdp_world_size": world_size,
        "fsdp_threads": threads,
        "local_step_s": med["local"],
        "fsdp_step_s": med["fsdp"],
        "fsdp_first_step_s": seconds["fsdp"][0],
        "fsdp_step_ratio": med["fsdp"] / med["local"],
    }
