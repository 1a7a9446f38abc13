"""Write a full state dict as an untied Hugging Face directory, whole and durable, for inference."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

from core.store.checkpoints import fsync_dir, fsync_tree

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def publish_checkpoint(tmp: Path, out_dir: Path, tokenizer_dir: Path) -> None:
    """Add the tokenizer files to the model written in `tmp`, fsync it, rename it to `out_dir`.

    Every engine writes its checkpoint to `tmp` first, so a reader never sees half of one.
    `out_dir` must not exist: each step attempt writes its own directory
    (`core.store.checkpoints`), so a directory that is there may already be committed,
    and replacing it could leave a committed version without its files.
    """
    tmp, out_dir, tokenizer_dir = Path(tmp), Path(out_dir), Path(tokenizer_dir)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.is_file() and not (tmp / name).exists():
            shutil.copy2(src, tmp / name)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists: a checkpoint is never written over")
    fsync_tree(tmp)
    tmp.rename(out_dir)
    fsync_dir(out_dir.parent)


def write_untied_hf(
    state: dict[str, torch.Tensor],
    config,
    generation_config,
    out_dir: Path,
    tokenizer_dir: Path,
) -> None:
    """Save `state` (HF names) under `out_dir` with an explicit head and the tokenizer files.

    A tied source model gets `lm_head.weight` as a copy of the embedding and
    `tie_word_embeddings: false` (vLLM's in-place reload skips tied weights).
    Written to `out_dir.tmp`, fsynced, then renamed, so a reader never sees half a checkpoint.
    The model class is built on the meta device from `config`: no second copy in memory.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    state = dict(state)
    head, emb = "lm_head.weight", "model.embed_tokens.weight"
    if head not in state or state[head].data_ptr() == state[emb].data_ptr():
        state[head] = state[emb].clone()
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if generation_config is not None:
        shell.generation_config = copy.deepcopy(generation_config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shell.save_pretrained(tmp, state_dict=state)
    publish_checkpoint(tmp, out_dir, tokenizer_dir)
