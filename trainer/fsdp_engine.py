"""FSDP2 training engine: the shared PPO step (`trainer.engine`) on every rank of a group.

What this engine owns, and nothing else (the step loop, the loss and the
metrics are `Engine.step`, the same as the local engine's):

- **Wrapping.** The HF model is wrapped in `PolicyLogits` (the head only at
  trained positions, inside the FSDP root's forward, which is what gathers
  the embedding, final norm and head), activation-checkpointed if asked,
  and `fully_shard`ed per decoder layer and at the root
  (`trainer.parallel`). The frozen reference (`kl_coef > 0`) is sharded the
  same way but never trained. One float32 rank runs unsharded (`shards`).
- **Micro-batches.** Packed rows up to `pack_tokens` tokens
  (`trainer.packing`) or padded groups of `micro_batch_size`.
- **Reduction.** Every micro-batch loss is divided by the GLOBAL trained
  token count, so FSDP's reduce-scatter must SUM gradients (divide factor
  1), not average them; counts and metrics are all-reduced
  (`DistributedEngine`), and `clip_grad_norm_` works on the DTensor shards.
- **State.** `save` gathers the full weights to rank 0; AdamW's moments
  survive from one step (one torchrun process group) to the next as DCP
  shards (`trainer.fsdp_checkpoint`) when the run sets `save_optimizer_state`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer.batch import Sample
from trainer.engine import DistributedEngine
from trainer.fsdp_checkpoint import load_optimizer_state, save_optimizer_state
from trainer.hf_io import write_untied_hf
from trainer.logprobs import Forward, PolicyLogits, hf_forward
from trainer.packing import greedy_pack_groups
from trainer.parallel import DTYPES, apply_activation_checkpointing, apply_fsdp

logger = logging.getLogger(__name__)


class FsdpEngine(DistributedEngine):
    """The HF policy fully sharded over the process group; AdamW's state as DCP shards."""

    policy: PolicyLogits

    def load_model(self, model_dir: Path, *, train: bool) -> PolicyLogits:
        """An HF directory loaded on every rank, wrapped in PolicyLogits and fully sharded.

        The frozen reference (train=False) is sharded too, so it costs each
        rank 1/world of its weights; it never needs gradients or checkpointing.
        """
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=self.parallel.attn_implementation
        )
        model = PolicyLogits(self.with_adapter(lm, train=train)).to(self.dist.device)
        model.train(train)
        if not self.cfg.lora:  # a LoRA policy's base is frozen by `with_adapter`
            model.requires_grad_(train)
        if train and self.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        if not self.shards:
            return model
        apply_fsdp(
            model,
            self.dist.mesh,
            param_dtype=self.compute_dtype,
            reduce_dtype=DTYPES[self.parallel.reduce_dtype],
            reshard_after_forward=self.parallel.reshard_after_forward,
            gradient_divide_factor=1.0,  # the loss already divides by the global token count
        )
        return model

    @property
    def shards(self) -> bool:
        """Whether to `fully_shard` at all. One float32 rank has nothing to shard, and FSDP's
        all-gathers and reduce-scatters there are copies of the whole model each pass, so
        the model runs as loaded (as torchtitan applies FSDP only when dp_shard > 1).
        Mixed precision needs FSDP's policy, so a bfloat16 rank is still wrapped."""
        float32 = (self.parallel.param_dtype, self.parallel.reduce_dtype) == ("float32",) * 2
        return self.world_size > 1 or not float32

    def micro_batches(self, mine: list[Sample]) -> list[list[Sample]]:
        if self.parallel.packing:
            return greedy_pack_groups(mine, self.parallel.pack_tokens)
        return super().micro_batches(mine)

    def forward(self, chunk: list[Sample]) -> Forward:
        return hf_forward(
            self.policy,
            self.reference,
            chunk,
            self.pad_id,
            self.dist.device,
            packing=self.parallel.packing,
            dtype=self.compute_dtype,
        )

    def trained_parameters(self) -> Iterable[nn.Parameter]:
        return self.trainable(self.policy.parameters())

    def load_optimizer(self, state_dir: Path | None) -> bool:
        """Resume AdamW from `state_dir` if it holds the state for this version. Collective."""
        self.optimizer_resumed = load_optimizer_state(
            self.policy, self.optimizer, state_dir, self.version
        )
        return self.optimizer_resumed

    def save_optimizer(self, state_dir: Path) -> None:
        """Save AdamW's sharded state for the version just trained. Collective."""
        save_optimizer_state(self.policy, self.optimizer, state_dir, self.version)

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Gather the full weights to rank 0 and write an untied HF directory atomically
        (a LoRA run: the adapter alone).

        Collective: every rank must call it. Rank 0 writes `out_dir.tmp`, then
        renames; the barrier keeps other ranks from returning before that.
        """
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # a full state dict holds tensors only; empty on ranks > 0
        state = cast(dict[str, torch.Tensor], get_model_state_dict(self.policy, options=opts))
        if self.rank == 0 and self.cfg.lora:
            # PolicyLogits' "lm." is the PeftModel's "base_model.model."
            state = {"base_model.model." + k.removeprefix("lm."): v for k, v in state.items()}
            self.save_adapter(out_dir, tokenizer_dir, state)
        elif self.rank == 0:
            lm = self.policy.lm
            state = {k.removeprefix("lm."): v for k, v in state.items()}
            write_untied_hf(state, lm.config, lm.generation_config, out_dir, tokenizer_dir)
        dist.barrier()
