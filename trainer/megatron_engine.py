"""Megatron-core training engine (GPU only): the shared PPO step on a Megatron GPT model.

Selected with `engine: "megatron"` in the run config and run like the FSDP
engine, on resident torchrun ranks (`trainer.resident_rank`). megatron-core
is an optional extra (`pip install 'rlgate[megatron]'`) and cannot run a
forward pass without CUDA, so everything that touches it is imported inside
the engine; `megatron_unavailable` says, without importing it, why the
engine cannot run on this machine.

The step loop, the loss and the metrics are `trainer.engine.Engine.step`,
the same as the other engines'; this engine owns the model and the reduction:

1. The HF checkpoint of version N is read, converted to Megatron-core names
   (`trainer.megatron_convert`) and loaded into a `GPTModel` built from the
   mapped `TransformerConfig`. The Transformer Engine layer spec is used when
   `transformer_engine` is importable, else Megatron-core's local spec.
2. Padded micro-batches of `micro_batch_size`. Logits come from
   `GPTModel.forward(input_ids, position_ids, attention_mask=None)` (a
   causal mask is built inside; right padding never reaches a real
   position); logprobs and entropy are taken at the trained positions by
   `trainer.logprobs.logprobs_at`, as in the other engines.
3. Data parallel only (tensor and pipeline parallel size 1): every rank
   holds the whole model, and gradients are SUMMED over ranks by hand
   before clipping (the loss is already globally normalised).
4. `save` converts back to HF names on rank 0 and writes the same untied
   directory as the other engines.

Departs from a Megatron pre-training loop in that it uses torch's AdamW and
an explicit all-reduce instead of Megatron's distributed optimizer and DDP
wrapper: one optimizer step per batch, so the overlap they buy is small,
and the step stays the one every engine runs.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.batch import Sample, collate
from trainer.engine import DistributedEngine, read_optimizer_file, save_optimizer_file
from trainer.engine_check import EngineUnavailable, engine_unavailable
from trainer.logprobs import Forward, logprobs_at, to_device
from trainer.packing import trainable_batch
from trainer.parallel import init_distributed

logger = logging.getLogger(__name__)


class MegatronUnavailable(EngineUnavailable):
    """engine='megatron' on a machine that cannot run it (no CUDA, or no megatron-core)."""


def megatron_unavailable() -> str | None:
    """Why `engine='megatron'` cannot run on this machine, or None if it can."""
    return engine_unavailable("megatron")


def read_hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files (one file or shards)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


class MegatronEngine(DistributedEngine):
    """A Megatron-core GPTModel replicated on every rank; AdamW's state in `optimizer.pt`."""

    def join_group(self) -> None:
        """Refuse a machine that cannot run megatron-core, before any process group forms."""
        reason = megatron_unavailable()
        if reason:
            raise MegatronUnavailable(reason)
        from megatron.core import parallel_state

        self.joined(init_distributed("nccl"))
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1
            )

    def seed(self) -> None:
        from megatron.core import tensor_parallel

        super().seed()
        tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.seed + self.version)

    def _layer_spec(self):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        if importlib.util.find_spec("transformer_engine") is not None:
            return get_gpt_layer_with_transformer_engine_spec(), False
        return get_gpt_layer_local_spec(normalization="RMSNorm"), True

    def load_model(self, model_dir: Path, *, train: bool) -> nn.Module:
        """A GPTModel on this rank's GPU holding the HF weights of `model_dir` (fp32 master)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        from trainer.megatron_convert import hf_to_megatron, megatron_model_kwargs, to_local_spec

        config_kw, gpt_kw = megatron_model_kwargs(self.hf_config, torch.float32)
        spec, local = self._layer_spec()
        model = GPTModel(
            config=TransformerConfig(**config_kw),
            transformer_layer_spec=spec,
            pre_process=True,
            post_process=True,
            **gpt_kw,
        ).to(self.dist.device)
        state = hf_to_megatron(read_hf_state(model_dir), self.hf_config)
        if gpt_kw["share_embeddings_and_output_weights"]:
            state.pop("output_layer.weight")
        if local:
            state = to_local_spec(state)
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"Megatron model and converted weights differ: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
        model.train(train)
        model.requires_grad_(train)
        self._local_spec = local
        return model

    def _logits(self, model, batch) -> torch.Tensor:
        ids = batch.input_ids
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        mixed = self.compute_dtype != torch.float32
        with torch.autocast("cuda", dtype=self.compute_dtype, enabled=mixed):
            return model(ids, pos, None)  # [B, T, V]; None: the causal mask is built inside

    def forward(self, chunk: list[Sample]) -> Forward:
        batch = to_device(trainable_batch(collate(chunk, self.pad_id)), self.dist.device)
        select = batch.loss_mask[:, 1:] > 0
        ids, temps = batch.input_ids, batch.temperatures
        rows = self._logits(self.policy, batch)[:, :-1][select]
        logp, entropy = logprobs_at(rows, ids, select, temps, with_entropy=True)
        if entropy is None:
            raise RuntimeError("logprobs_at returned no entropy")
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                rows = self._logits(self.reference, batch)[:, :-1][select]
                ref, _ = logprobs_at(rows, ids, select, temps, with_entropy=False)
        return Forward(logp, entropy, ref, batch)

    def trained_parameters(self) -> Iterable[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def clip_gradients(self) -> float:
        """SUM the gradients over ranks (no DDP wrapper), then clip the global norm."""
        for p in self.trained_parameters():
            if p.grad is None:  # a rank without samples still joins the collective
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        return super().clip_gradients()

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Rank 0 converts back to HF names and writes the untied directory. Collective."""
        if self.rank == 0:
            from transformers import AutoConfig, GenerationConfig

            from trainer.hf_io import write_untied_hf
            from trainer.megatron_convert import from_local_spec, megatron_to_hf

            state = {
                k: v.detach().to("cpu", torch.float32)
                for k, v in self.policy.state_dict().items()
                if not k.endswith("_extra_state")
            }
            if self._local_spec:
                state = from_local_spec(state)
            try:
                generation = GenerationConfig.from_pretrained(self.checkpoint_dir)
            except OSError:
                generation = None
            write_untied_hf(
                megatron_to_hf(state, self.hf_config),
                AutoConfig.from_pretrained(self.checkpoint_dir),
                generation,
                out_dir,
                tokenizer_dir,
            )
        dist.barrier()

    def save_optimizer(self, state_dir: Path) -> None:
        """Every rank holds the same AdamW state (data parallel only): rank 0 writes it."""
        if self.rank == 0:
            save_optimizer_file(self.optimizer, state_dir, self.version)
        dist.barrier()

    def load_optimizer(self, state_dir: Path | None) -> bool:
        """Resume AdamW if `state_dir` holds the state for this version, else start fresh.

        All or nothing: if any rank cannot read it, every rank starts fresh.
        """
        state, why = read_optimizer_file(state_dir, self.version, self.dist.device)
        (agreed,) = self.all_reduce([0.0 if state is None else 1.0], op=dist.ReduceOp.MIN)
        if agreed and state is not None:
            self.optimizer.load_state_dict(state)
        elif self.rank == 0:
            logger.warning("fresh AdamW state for v%d: %s", self.version, why or "a rank lacks it")
        self.optimizer_resumed = bool(agreed)
        return self.optimizer_resumed

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        super().close()
