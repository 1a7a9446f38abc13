"""Start `torchrun` from a Celery worker: the command, the ranks' environment, their logs.

A Celery prefork child cannot fork multiprocessing children, so the worker
starts `python -m torch.distributed.run` with fork+exec instead
(`trainer.resident` runs it as a `TetheredProcess`, and each rank dies with
torchrun, so a killed worker leaves no rank behind). torchrun writes each
rank's stdout/stderr under `logs/` (`--redirects 3`); `rank_tails` gathers
their ends for an error message, since the interesting traceback is rarely
on rank 0. Samples travel to the ranks as plain lists (`write_samples`),
loadable with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from trainer.batch import Sample

TAIL_CHARS = 4000


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
    module: str,
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
