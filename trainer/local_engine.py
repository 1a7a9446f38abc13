"""Single-process training engine: the shared PPO step on a plain Hugging Face model, CPU float32.

The step itself is `trainer.engine.Engine.step`; this engine only
loads the model, wraps it in `PolicyLogits` (logits only at the positions
that predict a sampled token, `trainer.logprobs`), and saves. It is the
reference the FSDP and Megatron engines are compared against.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference.models import own_memory
from trainer.batch import Batch, Sample
from trainer.engine import Engine, read_optimizer_file, save_optimizer_file
from trainer.hf_io import publish_checkpoint
from trainer.logprobs import Forward, PolicyLogits, hf_forward, token_logprobs
from trainer.packing import packed_length
from trainer.weight_server import hf_state

logger = logging.getLogger(__name__)


class LocalEngine(Engine):
    """The HF model as loaded, in this process; AdamW's state in `state_dir/optimizer.pt`."""

    policy: PolicyLogits

    def load_model(self, model_dir: Path, *, train: bool) -> PolicyLogits:
        from transformers import AutoModelForCausalLM

        if train and self.cfg.lora and self.bases is not None:
            lm = self.bases.copy_of(model_dir)  # the worker's one frozen copy of the base
        else:
            lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            if train:  # the frozen reference is only read: its pages can stay mapped
                own_memory(lm)
        lm.train(train)
        lm.requires_grad_(train)
        return PolicyLogits(self.with_adapter(lm, train=train))

    @property
    def model(self) -> nn.Module:
        """The Hugging Face model being trained."""
        return self.policy.lm

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return hf_state(self.model)

    def token_logprobs(self, batch: Batch, model: nn.Module | None = None) -> torch.Tensor:
        """[B, T] logprobs of input_ids[:, t] under the model at temperature; 0 off the mask."""
        policy = self.policy if model is None else PolicyLogits(model)
        logp, _ = token_logprobs(
            policy, batch.input_ids, batch.attention_mask, None, batch.loss_mask, batch.temperatures
        )
        return logp

    def forward(self, chunk: list[Sample]) -> Forward:
        # One packed row, a group's shared prompt held once, while its [T, T] mask stays
        # within `parallel.pack_tokens`; longer micro-batches take the padded layout.
        par = self.cfg.parallel
        packing = par.packing and packed_length(chunk) <= par.pack_tokens
        return hf_forward(
            self.policy, self.reference, chunk, self.pad_id, torch.device("cpu"), packing=packing
        )

    def trained_parameters(self) -> Iterable[nn.Parameter]:
        return self.trainable(self.model.parameters())

    def save_optimizer(self, state_dir: Path) -> None:
        """AdamW state for the version just trained (overwritten each step, atomically)."""
        save_optimizer_file(self.optimizer, state_dir, self.version)

    def load_optimizer(self, state_dir: Path | None) -> bool:
        """Resume AdamW's moments if `state_dir` holds them for this engine's version."""
        state, why = read_optimizer_file(state_dir, self.version)
        if state is None:
            logger.warning("fresh AdamW for v%d: %s", self.version, why)
        else:
            self.optimizer.load_state_dict(state)
        self.optimizer_resumed = state is not None
        return self.optimizer_resumed

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Write an untied HF directory (a LoRA run: the adapter) to `out_dir` atomically."""
        if self.cfg.lora:
            self.save_adapter(out_dir, tokenizer_dir)
            return
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        lm: Any = self.model  # a Hugging Face PreTrainedModel
        lm.save_pretrained(tmp)
        publish_checkpoint(tmp, out_dir, tokenizer_dir)
