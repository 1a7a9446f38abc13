"""torchrun entry point: one FSDP (or Megatron) step on this rank, then the collective save.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m trainer.fsdp_worker --checkpoint-dir=... --version=N --config=config.json \\
        --samples=samples.pt --out-dir=... --tokenizer-dir=... --metrics=metrics.json \\
        [--reference-dir=BASE] [--optimizer-in=DIR] [--optimizer-out=DIR]

Normally started by `trainer.launch.run_fsdp_step`, which documents the files.
The run config's `engine` picks the class through `trainer.engines`
(`FsdpEngine`, or `MegatronEngine`, imported only then since megatron-core
is an optional GPU-only extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from trainer.config import ParallelConfig, RunConfig
from trainer.engines import engine_class, torchrun_engine
from trainer.launch import read_samples
from trainer.resident_rank import die_with_launcher


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer.fsdp_worker", description=__doc__)
    p.add_argument("--checkpoint-dir", type=Path, required=True, help="version N (HF directory)")
    p.add_argument("--version", type=int, required=True, help="N")
    p.add_argument("--config", type=Path, required=True, help='{"run": {...}, "parallel": {...}}')
    p.add_argument("--samples", type=Path, required=True, help="torch.save'd list of samples")
    p.add_argument("--out-dir", type=Path, required=True, help="where version N+1 is written")
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--metrics", type=Path, required=True, help="rank 0 writes JSON here")
    p.add_argument("--reference-dir", type=Path, help="frozen base model (kl_coef > 0, LoRA)")
    p.add_argument("--optimizer-in", type=Path, help="AdamW state saved for version N, if any")
    p.add_argument("--optimizer-out", type=Path, help="where to save AdamW's state for N+1")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()  # torchrun starts each rank in a session of its own
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    conf = json.loads(args.config.read_text())
    cfg = RunConfig.model_validate(conf["run"])
    parallel = ParallelConfig.model_validate(conf.get("parallel") or {})
    samples = read_samples(args.samples)  # before the model load, so a bad file fails fast
    engine = engine_class(torchrun_engine(cfg.engine))(
        args.checkpoint_dir, args.version, cfg, parallel, reference_dir=args.reference_dir
    )
    try:
        if args.optimizer_in is not None or args.optimizer_out is not None:
            engine.load_optimizer(args.optimizer_in)
        metrics = engine.step(samples)
        if args.optimizer_out is not None:
            engine.save_optimizer(args.optimizer_out)
        engine.save(args.out_dir, args.tokenizer_dir)
        if engine.rank == 0:
            # written last and renamed, so the launcher never sees a half-written file
            tmp = args.metrics.with_name(args.metrics.name + ".tmp")
            tmp.write_text(json.dumps({**metrics, "version": engine.version}))
            os.replace(tmp, args.metrics)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
