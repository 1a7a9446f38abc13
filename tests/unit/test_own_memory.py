"""`inference.models.own_memory`: a loaded model's tensors leave the checkpoint's file mapping.

`from_pretrained` maps a safetensors file copy-on-write; the first write to each
page then faults and copies it, in the middle of the first optimizer step or hot
swap. The trainer's local engine and the local backend copy the tensors up front.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from inference.local import LocalBackend
from inference.models import own_memory
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine


def _file_backed(model: torch.nn.Module, model_dir: Path) -> int:
    """How many of the model's tensors lie inside a mapping of the model directory's files."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(model_dir.resolve())):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            spans.append((lo, hi))
    tensors = [*model.parameters(), *model.buffers()]
    return sum(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors)


def test_from_pretrained_maps_the_file_and_own_memory_copies_out(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert _file_backed(model, tiny_model_dir) > 0  # what own_memory is for
    assert own_memory(model) is model
    assert _file_backed(model, tiny_model_dir) == 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_trained_model_and_the_served_one_own_their_memory(tiny_model_dir: Path) -> None:
    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2)
    engine = LocalEngine(tiny_model_dir, 0, cfg)
    assert _file_backed(engine.model, tiny_model_dir) == 0
    backend = LocalBackend(tiny_model_dir)
    assert _file_backed(backend.model, tiny_model_dir) == 0
