"""One frozen copy of a base model for every LoRA run a worker trains (docs/lora.md).

A LoRA run trains only its adapter; its base weights are frozen and never written.
Each in-process LoRA engine gets its own module tree (`copy_of`): a deep copy of
the base whose parameters are the base's own tensors, so the weights are held once
per worker however many LoRA runs (or policies of one run, docs/policies.md) it
keeps warm, and each engine injects, trains and saves its adapter on its own tree.
A copy costs its modules and buffers (the rotary tables), not its weights.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path

import torch
from torch import nn

from inference.models import own_memory

logger = logging.getLogger(__name__)


class SharedBases:
    """Base models by directory, each loaded once and frozen; engines take `copy_of` it."""

    def __init__(self) -> None:
        self._bases: dict[Path, nn.Module] = {}
        self._lock = threading.Lock()

    def copy_of(self, model_dir: Path) -> nn.Module:
        """A module tree of the base model in `model_dir` that shares its frozen weights."""
        key = Path(model_dir).resolve()
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                from transformers import AutoModelForCausalLM

                base = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
                own_memory(base)
                base.requires_grad_(False)
                self._bases[key] = base
                logger.info("loaded the shared base %s", key)
        shared = {id(p): p for p in base.parameters()}
        return copy.deepcopy(base, memo=shared)

    def __len__(self) -> int:
        return len(self._bases)
