"""torchrun entry point: one FSDP step on this rank, then the collective save.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m trainer.fsdp_worker --checkpoint-dir=... --version=N --config=config.json \\
        --samples=samples.pt --out-dir=... --tokenizer-dir=... --metrics=metrics.json

Normally started by `trainer.launch.run_fsdp_step`, which documents the files.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from trainer.config import ParallelConfig, RunConfig
from trainer.fsdp_engine import FsdpEngine
from trainer.launch import read_samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer.fsdp_worker", description=__doc__)
    p.add_argument("--checkpoint-dir", type=Path, required=True, help="version N (HF directory)")
    p.add_argument("--version", type=int, required=True, help="N")
    p.add_argument("--config", type=Path, required=True, help='{"run": {...}, "parallel": {...}}')
    p.add_argument("--samples", type=Path, required=True, help="torch.save'd list of samples")
    p.add_argument("--out-dir", type=Path, required=True, help="where version N+1 is written")
    p.add_argument("--tokenizer-dir", type=Path, required=True)
    p.add_argument("--metrics", type=Path, required=True, help="rank 0 writes JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    conf = json.loads(args.config.read_text())
    cfg = RunConfig.model_validate(conf["run"])
    parallel = ParallelConfig.model_validate(conf.get("parallel") or {})
    samples = read_samples(args.samples)  # before the model load, so a bad file fails fast
    engine = FsdpEngine(args.checkpoint_dir, args.version, cfg, parallel)
    try:
        metrics = engine.step(samples)
        engine.save(args.out_dir, args.tokenizer_dir)
        if engine.dist.rank == 0:
            # written last and renamed, so the launcher never sees a half-written file
            tmp = args.metrics.with_name(args.metrics.name + ".tmp")
            tmp.write_text(json.dumps({**metrics, "version": engine.version}))
            os.replace(tmp, args.metrics)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
