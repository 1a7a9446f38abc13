"""The `rlgate` command: demo, up, worker, runs create, export, bench and inference."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from core.settings import Settings
from inference import registry

NODE_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "nproc_per_node")


def _demo(args: argparse.Namespace) -> int:
    from rlgate.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        model=args.model, out=Path(args.out), seed=args.seed, port=args.port, backend=args.backend
    )
    if args.steps is not None:
        cfg.steps = args.steps
    if args.group_size is not None:
        cfg.group_size = args.group_size
    if args.groups_per_step is not None:
        cfg.groups_per_step = args.groups_per_step
    if args.max_waves is not None:
        cfg.max_waves_per_step = args.max_waves
    if args.patience is not None:
        cfg.patience = args.patience
    if args.eval_every is not None:
        cfg.eval_every = args.eval_every
    if args.lora_rank is not None:  # an adapter learns at a larger rate than every weight
        cfg.run_config["lora_rank"] = args.lora_rank
        cfg.learning_rate = args.learning_rate or LORA_DEMO_LEARNING_RATE
    elif args.learning_rate is not None:
        cfg.learning_rate = args.learning_rate
    return run_demo(cfg, Settings())


def _up(args: argparse.Namespace) -> int:
    from rlgate.serve import serve
    from rlgate.stack import start_worker, stop, with_secrets

    update = {"data_dir": Path(args.data_dir)} if args.data_dir else {}
    if args.workers is not None:
        update["gateway_workers"] = args.workers
    settings = with_secrets(Settings().model_copy(update=update))
    try:  # fail early (or warn) about the admin credential, before the worker starts
        settings.resolved_admin_key(args.host)
        settings.check_workers()
    except ValueError as exc:
        print(f"rlgate up: {exc}", file=sys.stderr)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    worker = None if args.no_worker else start_worker(settings, settings.data_dir / "worker.log")
    # uvicorn restores the SIGTERM handler it found and re-raises the signal once it has
    # shut down; with Python's default handler that would end this process before the
    # `finally` below stops the worker, so the handler it finds turns SIGTERM into an exit.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        serve(settings, args.host, args.port, settings.gateway_workers)
    finally:
        if worker is not None:
            stop(worker)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from trainer.worker import run_worker

    # the node flags override RLGATE_NNODES & co. (docs/multinode.md)
    flags = {k: v for k, v in vars(args).items() if k in NODE_FLAGS and v is not None}
    run_worker(Settings(**flags))
    return 0


def _runs_create(args: argparse.Namespace) -> int:
    import httpx

    from core.settings import DEV_ADMIN_KEY

    url = os.environ.get("RLGATE_URL", "http://127.0.0.1:8000").rstrip("/")
    admin_key = os.environ.get("RLGATE_ADMIN_KEY") or DEV_ADMIN_KEY
    config = json.loads(args.config) if args.config else {}
    try:
        resp = httpx.post(
            f"{url}/admin/v1/runs",
            json={
                "name": args.name,
                "model": args.model,
                "config": config,
                "backend": args.backend,
                "replicas": args.replica or [],
            },
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=300,
        )
    except httpx.HTTPError as exc:
        print(f"cannot reach the gateway at {url}: {exc}", file=sys.stderr)
        return 1
    if resp.status_code >= 400:
        print(resp.text, file=sys.stderr)
        return 1
    run = resp.json()
    if args.json:
        print(json.dumps(run))
    else:
        print(f"run_id:   {run['run_id']}\napi_key:  {run['api_key']}\nbase_url: {run['base_url']}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from rlgate.export_cli import run_export

    return run_export(args)


# `rlgate bench NAME`: each module has `add_arguments(parser)` and `run(args)`, and imports
# its heavy dependencies inside `run`, so building the parser stays cheap.
# `rlgate demo --lora-rank`: about 10x the full fine-tune's 2e-5, the usual LoRA rule of thumb
LORA_DEMO_LEARNING_RATE = 2e-4

BENCHES = {
    "train": ("rlgate.bench.train", "packed vs padded training tokens/s"),
    "capture": ("rlgate.bench.capture", "completions/s persisted: group commit vs one each"),
    "gateway": ("rlgate.bench.gateway", "latency and req/s: stub vs rlgate vs LiteLLM proxy"),
    "e2e": ("rlgate.bench.e2e", "trained samples/s: max_staleness 0 vs 1 and 2"),
    "swap": (
        "rlgate.bench.swap",
        "vLLM hot-swap seconds vs a server restart; --stall: drain vs keep under load",
    ),
    "learn": ("rlgate.bench.learn", "held-out reward from one sample budget: rlgate vs TRL"),
    "tenants": ("rlgate.bench.tenants", "gateway memory of 1 vs 8 LoRA runs; adapter vs full swap"),
    "served": ("rlgate.bench.served", "last reward to new version served: fsdp vs local engine"),
    "sample": ("rlgate.bench.sample", "local backend tokens/s and TTFT vs generate()"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlgate", description="Reinforcement learning as an API.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the whole RL loop on the embedded default")
    demo.add_argument("--model", default="smollm2", help="smollm2, tiny or a local HF directory")
    demo.add_argument("--backend", default="local", choices=registry.startable_names())
    demo.add_argument("--steps", type=int, default=None, help="train steps (default 16)")
    demo.add_argument("--out", default="rlgate-demo", help="output directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--port", type=int, default=8766, help="loopback port for the gateway")
    demo.add_argument("--group-size", type=int, default=None, help="agents per GRPO group (6)")
    demo.add_argument(
        "--groups-per-step",
        type=int,
        default=None,
        help="groups with differing rewards a step needs (6)",
    )
    demo.add_argument(
        "--max-waves", type=int, default=None, help="waves per step before calling it converged (4)"
    )
    demo.add_argument(
        "--patience",
        type=int,
        default=None,
        help="stop once learned and this many versions set no new best reward (3; 0: never)",
    )
    demo.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="held-out evaluation at v0, every N versions and the last one (3; 0: none)",
    )
    demo.add_argument(
        "--lora-rank", type=int, default=None, help="train a LoRA adapter of this rank instead"
    )
    demo.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help=f"AdamW's rate (default 2e-5; {LORA_DEMO_LEARNING_RATE:g} with --lora-rank)",
    )
    demo.set_defaults(func=_demo)

    up = sub.add_parser("up", help="gateway + worker + local backend in the foreground")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--data-dir", default=None, help="default: RLGATE_DATA_DIR or ./rlgate-data")
    up.add_argument("--no-worker", action="store_true", help="gateway only (workers run elsewhere)")
    up.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes on the port (default: RLGATE_GATEWAY_WORKERS or 1); above 1 "
        "needs PostgreSQL and runs on vllm/sglang servers (docs/deployment.md)",
    )
    up.set_defaults(func=_up)

    worker = sub.add_parser("worker", help="a Celery worker for train steps")
    worker.add_argument("--nnodes", type=int, help="nodes of a resident FSDP group (default 1)")
    worker.add_argument("--node-rank", type=int, help="this node; only node 0 takes tasks")
    worker.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0's c10d rendezvous")
    worker.add_argument("--nproc-per-node", type=int, help="ranks on a joining node (default 1)")
    worker.set_defaults(func=_worker)

    runs = sub.add_parser("runs", help="manage runs on a gateway at RLGATE_URL")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    create = runs_sub.add_parser("create", help="create a run; prints its key and base_url")
    create.add_argument("--name", required=True)
    create.add_argument("--model", required=True, help="tiny, smollm2 or a local HF directory")
    create.add_argument("--config", default=None, help="RunConfig as JSON")
    create.add_argument("--backend", default="local", choices=registry.names())
    create.add_argument("--replica", action="append", help="remote backend's URL (repeatable)")
    create.add_argument("--json", action="store_true", help="print one JSON object")
    create.set_defaults(func=_runs_create)

    export = sub.add_parser(
        "export", help="write a run's episodes to a JSONL or Parquet file, or --merged its model"
    )
    export.add_argument("--run", required=True, help="run id")
    export.add_argument("--format", default="jsonl", choices=["jsonl", "parquet"])
    export.add_argument("--out", required=True, help="output file (replaced when complete)")
    export.add_argument("--status", default=None, help="only episodes with this status")
    export.add_argument(
        "--split",
        default="train",
        choices=["train", "eval"],
        help="train: training episodes (default); eval: evaluation (held-out) episodes only",
    )
    export.add_argument("--min-version", type=int, default=None, help="only newer samples")
    export.add_argument(
        "--merged",
        action="store_true",
        help="write the model instead: --out is a Hugging Face directory (LoRA merged in)",
    )
    export.add_argument("--version", type=int, default=None, help="--merged: default current")
    export.set_defaults(func=_export)

    bench = sub.add_parser("bench", help="figures against a baseline; the last line is JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module_name, help_text) in BENCHES.items():
        module = importlib.import_module(module_name)
        parser = module.add_arguments(bench_sub.add_parser(name, help=help_text))
        parser.set_defaults(func=module.run)
    from rlgate.inference_cli import add_arguments as inference_arguments

    inference_arguments(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
