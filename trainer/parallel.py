"""Explicit parallelism for the trainer: process group, FSDP2 sharding, activation checkpointing.

In the torchtitan style each transformation is a plain function applied in a
fixed order by the engine:

    dist = init_distributed(cfg.backend)           # gloo on CPU, nccl on CUDA
    apply_activation_checkpointing(model)          # optional, before sharding
    apply_fsdp(model, dist.mesh, param_dtype, reduce_dtype)

The same code runs gloo on CPU and NCCL on GPU; only `ParallelConfig`
differs. Decoder layers are found through Hugging Face's `_no_split_modules`
(the classes a model says must stay whole), so any HF causal LM works.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh


def resolve_backend(backend: str, local_ranks: int | None = None) -> str:
    """The process group's backend: "auto" is NCCL when this host has a CUDA device for each
    of its `local_ranks` (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun), else gloo.

    NCCL cannot put two ranks on one device: two ranks on a one-GPU host get gloo from
    "auto" and a clear error from "nccl" (found on a lent one-GPU H200).
    """
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if devices >= local_ranks else "gloo"
    if backend == "nccl" and devices < local_ranks:
        raise ValueError(
            f"backend 'nccl' needs a CUDA device per rank: {local_ranks} rank(s) on this host, "
            f"{devices} device(s); set backend to 'gloo' or 'auto'"
        )
    return backend


def init_distributed(backend: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...), or form a 1-rank group.

    A single process outside torchrun gets an in-memory store, so the engine
    and the bench run unchanged without a launcher.
    """
    backend = resolve_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistInfo(rank=dist.get_rank(), world_size=world, device=device, mesh=mesh)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (outermost wrapper if checkpointed), in order."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    layers: list[nn.Module] = []
    seen: set[int] = set()
    for m in model.modules():  # pre-order: a checkpoint wrapper comes before its layer
        inner = m._checkpoint_wrapped_module if isinstance(m, CheckpointWrapper) else m
        if type(inner).__name__ in names and id(inner) not in seen:
            seen.add(id(inner))
            layers.append(m)
    if not layers:
        raise ValueError(f"no decoder layers found in {type(model).__name__} (_no_split_modules)")
    return layers


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wrap every decoder layer so its activations are recomputed in backward (non-reentrant)."""
    targets = {id(m) for m in decoder_layers(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets and not isinstance(child, CheckpointWrapper):
                parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=False))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    gradient_divide_factor: float | None = None,
) -> FSDPModule:
    """fully_shard each decoder layer, then the root (embeddings, final norm, head).

    `gradient_divide_factor`: FSDP2 averages gradients over ranks by default;
    pass 1.0 when the loss is already normalised by a global count, so the
    reduce-scatter sums. A custom factor is applied around a plain SUM
    reduce-scatter (gloo has no PREMUL_SUM; NCCL's SUM is also its zero-copy op).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # the root's params are needed again at once by backward: keep them gathered
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    if gradient_divide_factor is not None:
        for m in [*layers, model]:
            sharded = cast(FSDPModule, m)  # fully_shard made it one, in place
            sharded.set_gradient_divide_factor(gradient_divide_factor)
            sharded.set_force_sum_reduction_for_comms(True)
    return model  # type: ignore[return-value]
