"""`rlgate bench train`: packed against padded tokens/s, and a worker step against a bare loop.

`ratio`: both modes run the same `FsdpEngine` (a one-rank process group in
this process) on the same batch of variable-length samples; only
`ParallelConfig.packing` differs. Tokens/s counts real tokens (prompt and
completion, never padding), so the ratio is padded time / packed time.
One warm-up step per mode, then the modes alternate for `repeats` steps and
the median is reported.

`step_ratio`: a 16-completion train step through the worker's code path
against a bare transformers loop on the same batch (`rlgate.bench.train_step`).

`fsdp_step_ratio` (with `--engine fsdp --world-size N`): the same step on the
run's resident FSDP ranks against the local engine (`rlgate.bench.train_fsdp`);
and `swap_s`, a new version into a vLLM CPU server from disk and over a gloo
collective (`weight_sync`, `rlgate.bench.train_swap`; `--no-swap` skips it).
Both parts run on the same torch thread count, printed. The last printed
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import TYPE_CHECKING, Any, cast

from rlgate.bench.dirs import add_dir_arguments, model_cache, work_dir

if TYPE_CHECKING:  # torch is imported only when the bench runs, not when the CLI parses
    from trainer.batch import Sample


def synthetic_samples(
    n: int, min_len: int, max_len: int, vocab: int, seed: int = 0
) -> list[Sample]:
    """`n` samples, lengths uniform in [min_len, max_len], the last ~70% of each trained."""
    from trainer.batch import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompt = max(1, int(length * 0.3))
        ids = [rng.randrange(vocab) for _ in range(length)]
        trained = length - prompt
        out.append(
            Sample(
                input_ids=ids,
                loss_mask=[0] * prompt + [1] * trained,
                old_logprobs=[0.0] * prompt + [-rng.uniform(3.0, 8.0) for _ in range(trained)],
                advantages=[0.0] * prompt + [rng.choice([-1.0, 1.0])] * trained,
                temperatures=[1.0] * length,
                min_version=0,
            )
        )
    return out


def bench_train(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """Median tokens/s of each mode (`add_arguments` names the options); `threads` is
    torch's intra-op thread count."""
    import torch

    from inference.models import resolve_model
    from trainer.config import ParallelConfig, RunConfig
    from trainer.fsdp_engine import FsdpEngine

    # one thread, as each torchrun rank gets: on a shared machine more threads mostly spin
    torch.set_num_threads(threads)
    model_dir = resolve_model(args.model, model_cache(args.cache_dir))
    cfg = RunConfig(
        learning_rate=1e-7,  # the weights barely move: both modes time the same model
        micro_batch_size=args.micro_batch_size,
        group_size=2,
        groups_per_step=max(1, -(-max(args.samples, args.micro_batch_size) // 2)),
        seed=args.seed,
    )
    base = ParallelConfig(pack_tokens=args.pack_tokens)
    engine = FsdpEngine(model_dir, 0, cfg, base)
    try:
        samples = synthetic_samples(
            args.samples,
            args.min_len,
            args.max_len,
            cast(Any, engine.policy.lm).config.vocab_size,
            args.seed,
        )
        tokens = sum(len(s.input_ids) for s in samples)
        modes = {"packed": True, "padded": False}
        rates: dict[str, list[float]] = {m: [] for m in modes}
        micro: dict[str, float] = {}
        for rep in range(args.repeats + 1):
            for mode, packing in modes.items():
                engine.parallel = base.model_copy(update={"packing": packing})
                t0 = time.perf_counter()
                metrics = engine.step(samples)
                seconds = time.perf_counter() - t0
                micro[mode] = metrics["micro_batches"]
                if rep > 0:  # rep 0 warms up allocators and kernels
                    rates[mode].append(tokens / seconds)
    finally:
        engine.close()
    for mode in modes:
        print(
            f"{mode}: {statistics.median(rates[mode]):.0f} tokens/s "
            f"(median of {args.repeats}; {args.samples} samples, {tokens} tokens, "
            f"{micro[mode]:.0f} micro-batches)"
        )
    shape = {"samples": args.samples, "tokens": tokens, "pack_tokens": args.pack_tokens}
    return packing_figures(
        rates, shape | {"micro_batch_size": args.micro_batch_size, "threads": threads}
    )


def packing_figures(rates: dict[str, list[float]], shape: dict[str, Any]) -> dict[str, Any]:
    """The `ratio` part of the bench's JSON from each mode's timed tokens/s (`packed`, `padded`)."""
    packed, padded = statistics.median(rates["packed"]), statistics.median(rates["padded"])
    return shape | {
        "repeats": len(rates["packed"]),
        "packed_tokens_per_s": packed,
        "padded_tokens_per_s": padded,
        "ratio": packed / padded,
    }


def summary(model: str, *parts: dict[str, Any]) -> dict[str, Any]:
    """The bench's JSON: its parts' figures (fsdp and swap first, when run), under one header."""
    out: dict[str, Any] = {"bench": "train", "model": model}
    for part in parts:
        out |= part
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The bench's options, for its own parser or an `rlgate bench train` subparser."""
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a local HF directory")
    add_dir_arguments(p, work="the step_ratio part's store and checkpoints")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8, help="padded mode")
    p.add_argument("--pack-tokens", type=int, default=1024, help="packed mode token budget")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default 0: the trainer's budget, RLGATE_TRAINER_THREADS)",
    )
    p.add_argument(
        "--step-repeats", type=int, default=5, help="step_ratio: warm steps timed per side"
    )
    p.add_argument(
        "--engine",
        default="local",
        choices=["local", "fsdp"],
        help="fsdp: also fsdp_step_ratio, a resident FSDP step / the local engine's",
    )
    p.add_argument("--world-size", type=int, default=1, help="--engine fsdp: ranks")
    p.add_argument(
        "--no-swap",
        action="store_true",
        help="--engine fsdp: skip swap_s (a version into a vLLM CPU server, disk vs collective)",
    )
    p.add_argument("--swap-repeats", type=int, default=5, help="--engine fsdp: swaps per mode")
    p.add_argument(
        "--fsdp-only",
        action="store_true",
        help="--engine fsdp: skip the ratio and step_ratio parts",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Run the bench from parsed options; prints a line per mode, then the JSON line."""
    from core.settings import Settings
    from inference.models import resolve_model
    from rlgate.bench.train_step import bench_step_ratio

    threads = args.threads or Settings().threads().trainer
    print(f"torch threads: {threads}")
    model_dir = resolve_model(args.model, model_cache(args.cache_dir))
    parts: list[dict[str, Any]] = []
    if args.engine == "fsdp":
        from rlgate.bench.train_fsdp import bench_fsdp_step_ratio

        with work_dir("train-fsdp", args.work_dir) as work:
            parts.append(
                bench_fsdp_step_ratio(model_dir, work, threads, args.step_repeats, args.world_size)
            )
        if not args.no_swap:
            from rlgate.bench.train_swap import bench_swap

            with work_dir("train-swap", args.work_dir) as work:
                parts.append(bench_swap(model_dir, work, args.swap_repeats))
        if args.fsdp_only:
            print(json.dumps(summary(args.model, *parts)))
            return 0
    parts.append(bench_train(args, threads))
    with work_dir("train", args.work_dir) as work:
        parts.append(bench_step_ratio(model_dir, work, threads, args.step_repeats))
    print(json.dumps(summary(args.model, *parts)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlgate bench train", description=__doc__.splitlines()[0])
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
