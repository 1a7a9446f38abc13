"""Sharded AdamW state for the FSDP engine: saved after step N, loaded by step N+1.

Each FSDP step is a fresh `torchrun` process group, so without this AdamW
would restart from zero moments every step. The state is written with
`torch.distributed.checkpoint` (DCP): every rank writes its own shard of
`get_optimizer_state_dict` (DTensors, no gather), rank 0 the metadata.
DCP reshards on load, so a later step may run on a different world size.

Layout of one saved state (a directory, one per version):

    .metadata, __<rank>_0.distcp    DCP's files
    meta.json                       {"version": N+1, "world_size": W}, written last

The directory is written as `<dir>.tmp` and renamed, so a reader sees a
complete state or none. Loading is collective and all-or-nothing: if any
rank cannot read the state for this version, every rank starts AdamW fresh
(and rank 0 logs why), so the ranks never disagree about the moments.
The learning-rate schedule needs no state here: it is a function of the
version (`trainer.local_engine.learning_rate`), and AdamW's own `step` counter
(its bias correction) is part of the saved state.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

logger = logging.getLogger(__name__)

META = "meta.json"


def saved_version(state_dir: Path) -> int | None:
    """The version a complete saved state is for, or None (missing or half-written)."""
    try:
        return int(json.loads((Path(state_dir) / META).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def save_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, out_dir: Path, version: int
) -> None:
    """Write this rank's shard of the AdamW state for `version`. Collective."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp))
    dist.barrier()  # every shard is on disk before the state is declared complete
    if rank == 0:
        meta = {"version": version, "world_size": dist.get_world_size()}
        (tmp / META).write_text(json.dumps(meta))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    dist.barrier()


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dir: Path | None, version: int
) -> bool:
    """Load the AdamW state saved for `version` into every rank, or leave AdamW fresh. Collective.

    Returns whether the state was loaded. Call before the first backward.
    """
    reason = None
    if state_dir is None:
        reason = "no saved state given"
    else:
        found = saved_version(Path(state_dir))
        if found is None:
            reason = f"no complete state in {state_dir}"
        elif found != version:
            reason = f"the state in {state_dir} is for v{found}, not v{version}"
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl() else None
    ok = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok.item()):
        if dist.get_rank() == 0:
            logger.warning("fresh AdamW state for v%d: %s", version, reason or "a rank lacks it")
        return False
    # a template with the live shapes and placements; DCP fills it in place, resharding if needed
    state = {"optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(state_dir))
    set_optimizer_state_dict(model, optimizer, state["optim"])
    if dist.get_rank() == 0:
        logger.info("resumed AdamW state of v%d from %s", version, state_dir)
    return True
