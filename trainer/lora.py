"""LoRA runs in the trainer: wrap the base model with a trainable adapter, and save it.

A LoRA run trains only the adapter; the base weights stay frozen and are
never written. Every version's checkpoint is a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`, what `peft`'s
`save_pretrained` writes) plus the tokenizer files; version 0 is the base
model's own directory (no adapter: a fresh adapter's B is zero, so base and
base + fresh adapter give the same logprobs).

The adapter is injected into the Hugging Face model in place
(`get_peft_model`), so the engines keep wrapping the same HF module in
`PolicyLogits`; the `PeftModel` is kept beside it for saving and for the KL
reference, which is the same model with the adapter switched off
(`BaseModelView`), not a second copy.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from torch import nn

from trainer.config import RunConfig
from trainer.hf_io import publish_checkpoint

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: Path) -> bool:
    """Whether `path` holds a PEFT adapter (a LoRA version), not a full model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def lora_config(cfg: RunConfig):
    """The `peft.LoraConfig` of a LoRA run's options."""
    from peft import LoraConfig

    if cfg.lora_rank is None:
        raise ValueError("lora_config needs lora_rank")
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.resolved_lora_alpha(),  # type: ignore[arg-type]  # peft takes a float
        target_modules=cfg.resolved_lora_targets(),
        lora_dropout=cfg.lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_lora(lm: nn.Module, cfg: RunConfig, adapter_dir: Path | None):
    """Inject a trainable adapter into `lm` in place; returns the `PeftModel` around it.

    `adapter_dir`: the adapter of the version being resumed; None starts a fresh
    one (seeded by the caller). Only the adapter's parameters require grad afterwards.
    """
    from peft import PeftModel, get_peft_model

    if adapter_dir is None:
        peft_model = get_peft_model(lm, lora_config(cfg))
    else:
        peft_model = PeftModel.from_pretrained(lm, adapter_dir, is_trainable=True)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    logger.info("LoRA rank %d: %d trainable parameters", cfg.lora_rank, trainable)
    return peft_model


class BaseModelView:
    """`policy` called with its adapter switched off: the frozen base, for the KL penalty.

    Not a module of its own: it shares every weight with the policy.
    """

    def __init__(self, policy: nn.Module, peft_model) -> None:
        self.policy, self.peft_model = policy, peft_model

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with self.peft_model.disable_adapter():
            return self.policy(*args, **kwargs)


def save_adapter(
    peft_model, out_dir: Path, tokenizer_dir: Path, state: dict[str, torch.Tensor] | None = None
) -> None:
    """Write the adapter (and the tokenizer files) to `out_dir` atomically.

    `state`: the full model state in `PeftModel` names (an FSDP engine gathers it
    first); None reads the adapter from `peft_model` itself.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {} if state is None else {"state_dict": state}
    peft_model.save_pretrained(tmp, **kwargs)
    publish_checkpoint(tmp, out_dir, tokenizer_dir)
