"""Run one FSDP train step as a `torchrun` subprocess and return rank 0's metrics.

This is the path without resident ranks (`RLGATE_RESIDENT_RANKS=false`; the
resident group is `trainer.resident`, which shares `torchrun_command`,
`rank_tails` and `kill_group` from here). A Celery prefork child cannot fork
multiprocessing children, so the worker starts `python -m
torch.distributed.run` with fork+exec instead. torchrun is tethered to this
process (`core.lifeline.TetheredProcess`) and each rank to torchrun, so a
killed worker leaves no rank behind. The hand-off is through files in a
scratch directory:

    samples.pt    plain lists (`write_samples`), read by every rank
    config.json   {"run": RunConfig dict, "parallel": ParallelConfig dict}
    metrics.json  written by rank 0 after the checkpoint is in place

AdamW's state (`optimizer_in` / `optimizer_out`, see `trainer.fsdp_checkpoint`)
and the frozen reference model (`reference_dir`) are plain directories the
ranks read and write themselves; with several nodes they must be on a
filesystem every node sees.
    logs/         torchrun's per-rank stdout/stderr (`--redirects 3`)

On failure the raised `FsdpStepError` carries the tail of every rank's
stderr, since the interesting traceback is rarely on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from core.lifeline import TetheredProcess
from trainer.batch import Sample
from trainer.lora import ADAPTER_CONFIG

TAIL_CHARS = 4000


class FsdpStepError(RuntimeError):
    """The torchrun step failed or timed out; the message holds the ranks' stderr tails."""


logger = logging.getLogger(__name__)


def write_samples(samples: list[Sample], path: Path) -> Path:
    """Serialise samples as plain lists (loadable with `weights_only=True`)."""
    torch.save([dataclasses.asdict(s) for s in samples], path)
    return path


def read_samples(path: Path) -> list[Sample]:
    return [Sample(**d) for d in torch.load(path, weights_only=True)]


def torchrun_command(
    world_size: int,
    log_dir: Path,
    worker_args: list[str],
    *,
    module: str = "trainer.fsdp_worker",
    rendezvous: list[str] | None = None,
) -> list[str]:
    """`python -m torch.distributed.run` starting `module` on `world_size` local ranks.

    `rendezvous`: torchrun's node and rendezvous flags (`NodeSpec.torchrun_args`);
    None: one node (`--standalone`).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rendezvous or ["--standalone"]),
        f"--nproc_per_node={world_size}",
        f"--log-dir={log_dir}",
        "--redirects=3",
        "-m",
        module,
        *worker_args,
    ]


def rank_env(threads_per_rank: int, **extra: str) -> dict[str, str]:
    """A rank's environment: this one, local checkpoints only, its torch thread budget."""
    return {
        **os.environ,
        **extra,
        "HF_HUB_OFFLINE": "1",  # checkpoints are local directories
        "OMP_NUM_THREADS": str(max(1, threads_per_rank)),
    }


def rank_tails(work: Path) -> str:
    """The tail of torchrun's own log and of every rank's stderr under `work`."""
    parts = []
    launcher = work / "torchrun.log"
    for path in [launcher, *sorted((work / "logs").rglob("stderr.log"))]:
        if path.is_file():
            text = path.read_text(errors="replace")[-TAIL_CHARS:]
            parts.append(f"--- {path.relative_to(work)} ---\n{text}")
    return "\n".join(parts) or "(no logs)"


def run_fsdp_step(
    checkpoint_dir: Path,
    version: int,
    cfg_dict: dict[str, Any],
    samples_path: Path,
    out_dir: Path,
    tokenizer_dir: Path,
    world_size: int,
    *,
    parallel: dict[str, Any] | None = None,
    reference_dir: Path | None = None,
    optimizer_in: Path | None = None,
    optimizer_out: Path | None = None,
    timeout_s: float = 3600.0,
    threads_per_rank: int = 1,
) -> dict[str, float]:
    """One step from `checkpoint_dir` (version N) to `out_dir` (N+1) on `world_size` ranks.

    `optimizer_in`: AdamW state saved for version N (a missing or mismatched
    one means fresh AdamW, logged by rank 0 and reported as
    `optimizer_resumed: 0`); `optimizer_out`: where the state for N+1 goes.
    `threads_per_rank`: each rank's `OMP_NUM_THREADS` (torch's intra-op
    threads), so that the ranks together stay within the trainer's budget.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if not any((Path(checkpoint_dir) / f).is_file() for f in ("config.json", ADAPTER_CONFIG)):
        # fail here, not in every rank (where transformers would read it as a hub repo id)
        raise FileNotFoundError(
            f"{checkpoint_dir} is neither a Hugging Face directory (config.json) "
            f"nor a LoRA adapter ({ADAPTER_CONFIG})"
        )
    work = Path(tempfile.mkdtemp(prefix="rlgate-fsdp-"))
    try:
        config = work / "config.json"
        config.write_text(json.dumps({"run": cfg_dict, "parallel": parallel or {}}))
        metrics = work / "metrics.json"
        args = [
            f"--checkpoint-dir={Path(checkpoint_dir).resolve()}",
            f"--version={version}",
            f"--config={config}",
            f"--samples={Path(samples_path).resolve()}",
            f"--out-dir={Path(out_dir).resolve()}",
            f"--tokenizer-dir={Path(tokenizer_dir).resolve()}",
            f"--metrics={metrics}",
        ]
        for flag, path in (
            ("reference-dir", reference_dir),
            ("optimizer-in", optimizer_in),
            ("optimizer-out", optimizer_out),
        ):
            if path is not None:
                args.append(f"--{flag}={Path(path).resolve()}")
        cmd = torchrun_command(world_size, work / "logs", args)
        with open(work / "torchrun.log", "wb") as log:
            proc = TetheredProcess(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=rank_env(threads_per_rank),
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise FsdpStepError(
                    f"FSDP step timed out after {timeout_s:.0f}s\n{rank_tails(work)}"
                ) from None
        if not metrics.is_file():
            raise FsdpStepError(f"FSDP step failed (torchrun exit {rc})\n{rank_tails(work)}")
        if rc != 0:
            # Rank 0 writes the metrics last, after the step and the checkpoint are complete;
            # a rank that dies after that died in process-group teardown, not in the step.
            logger.warning("torchrun exited %d after the step completed:\n%s", rc, rank_tails(work))
        result = json.loads(metrics.read_text())
        if optimizer_in is not None and not result.get("optimizer_resumed"):
            logger.warning(
                "step from v%d started AdamW fresh: no usable state in %s", version, optimizer_in
            )
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Stop torchrun and its rank processes (they share the session we started)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
