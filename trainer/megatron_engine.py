"""Megatron-core training engine (GPU only): the LocalEngine step on a Megatron GPT model.

Selected with `engine: "megatron"` in the run config and launched like the
FSDP engine (`torchrun` ranks running `trainer.fsdp_worker`). megatron-core
is an optional extra (`pip install 'rlgate[megatron]'`) and cannot run a
forward pass without CUDA, so everything that touches it is imported inside
the engine; `megatron_unavailable` says, without importing it, why the
engine cannot run on this machine.

One step, top to bottom (`MegatronEngine.step`):

1. The HF checkpoint of version N is read, converted to Megatron-core names
   (`trainer.megatron_convert`) and loaded into a `GPTModel` built from the
   mapped `TransformerConfig`. The Transformer Engine layer spec is used when
   `transformer_engine` is importable, else Megatron-core's local spec.
2. Each rank takes its share of the samples (`shard_for_rank`, as in the
   FSDP engine) in padded micro-batches of `micro_batch_size`; the trained
   token and sequence counts are all-reduced first, so every micro-batch on
   every rank divides by the same global denominator.
3. Logits come from `GPTModel.forward(input_ids, position_ids,
   attention_mask=None)` (a causal mask is built inside; right padding
   never reaches a real position); logprobs and entropy are taken at the
   trained positions and fed to `trainer.losses.policy.policy_loss`, the
   loss every engine uses (PPO-clip, KL to the frozen base, entropy bonus).
4. Data parallel only (tensor and pipeline parallel size 1): gradients are
   SUMMED over ranks (the loss is already globally normalised), clipped,
   and AdamW steps at the schedule's learning rate.
5. `save` converts back to HF names on rank 0 and writes the same untied
   directory as the other engines.

Departs from a Megatron pre-training loop in that it uses torch's AdamW and
an explicit all-reduce instead of Megatron's distributed optimizer and DDP
wrapper: one optimizer step per batch, so the overlap they buy is small,
and the step stays comparable line by line with the other engines.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.batch import Batch, Sample, collate
from trainer.config import ParallelConfig, RunConfig
from trainer.engine import advantage_stats, learning_rate, optimizer_step
from trainer.engine_check import EngineUnavailable, engine_unavailable
from trainer.losses.policy import policy_loss
from trainer.packing import padded_groups, trainable_batch
from trainer.parallel import DTYPES, init_distributed

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"


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


def selected_logprobs(
    logits: torch.Tensor, batch, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprobs of the targets (and entropy) from [B, T, V] logits; 0 off the mask.

    The same arithmetic as `LocalEngine._logprobs_and_entropy`: position t-1
    predicts token t, at token t's sampling temperature.
    """
    where = batch.loss_mask[:, 1:] > 0
    rows = logits[:, :-1][where].float() / batch.temperatures[:, 1:][where][:, None]
    logp = torch.log_softmax(rows, dim=-1)
    picked = logp.gather(-1, batch.input_ids[:, 1:][where][:, None]).squeeze(-1)
    out = torch.zeros(where.shape, dtype=picked.dtype, device=picked.device)
    out[where] = picked
    pad = torch.zeros_like(out[:, :1])
    ent = None
    if with_entropy:
        ent = torch.zeros_like(out)
        ent[where] = -(logp.exp() * logp).sum(-1)
        ent = torch.cat([pad, ent], dim=1)
    return torch.cat([pad, out], dim=1), ent


class MegatronEngine:
    """Same surface as `FsdpEngine`: step, save, load/save_optimizer, close. Every rank runs it."""

    def __init__(
        self,
        checkpoint_dir: Path,
        version: int,
        cfg: RunConfig,
        parallel: ParallelConfig | None = None,
        reference_dir: Path | None = None,
    ) -> None:
        reason = megatron_unavailable()
        if reason:
            raise MegatronUnavailable(reason)
        from megatron.core import parallel_state, tensor_parallel

        self.cfg = cfg
        self.parallel = parallel or ParallelConfig()
        self.version = version
        self.dist = init_distributed("nccl")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1
            )
        torch.manual_seed(cfg.seed + version)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed + version)
        self.hf_config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        self.source_dir = Path(checkpoint_dir)
        self.pad_id = self.hf_config.get("pad_token_id") or 0
        self.compute_dtype = DTYPES[self.parallel.param_dtype]
        self.model = self._build(checkpoint_dir, train=True)
        self.reference = None
        if cfg.kl_coef > 0:  # the frozen base model, for the KL penalty
            if reference_dir is None:
                raise ValueError("kl_coef > 0 needs the reference model's directory")
            self.reference = self._build(reference_dir, train=False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=learning_rate(cfg, version), weight_decay=cfg.weight_decay
        )
        self.optimizer_resumed = False

    def _layer_spec(self):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        if importlib.util.find_spec("transformer_engine") is not None:
            return get_gpt_layer_with_transformer_engine_spec(), False
        return get_gpt_layer_local_spec(normalization="RMSNorm"), True

    def _build(self, model_dir: Path, *, train: bool):
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

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.dist.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _logits(self, model, batch) -> torch.Tensor:
        ids = batch.input_ids
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        mixed = self.compute_dtype != torch.float32
        with torch.autocast("cuda", dtype=self.compute_dtype, enabled=mixed):
            return model(ids, pos, None)  # [B, T, V]; None: the causal mask is built inside

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over all ranks' samples, one global denominator."""
        from trainer.fsdp_engine import shard_for_rank

        t0 = time.perf_counter()
        cfg = self.cfg
        mine = shard_for_rank(samples, self.dist.rank, self.dist.world_size)
        trained = sum(sum(s.loss_mask[1:]) for s in mine)  # position 0 is never trained
        n_tokens, n_seqs, n_total = self._all_reduce(
            [trained, len(mine), sum(len(s.input_ids) for s in mine)]
        )
        denom = max(n_tokens, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        keys = ["clip_frac", "approx_kl", "ratio_mean", "iw_mean", "entropy"]
        if self.reference is not None:
            keys.append("kl_ref")
        local = dict.fromkeys(("loss", *keys), 0.0)
        ratio_max = 0.0
        for chunk in padded_groups(mine, cfg.micro_batch_size):
            batch = trainable_batch(collate(chunk, self.pad_id))
            batch = Batch(*(getattr(batch, f.name).to(self.dist.device) for f in fields(batch)))
            logp, entropy = selected_logprobs(
                self._logits(self.model, batch), batch, with_entropy=True
            )
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = selected_logprobs(
                        self._logits(self.reference, batch), batch, with_entropy=False
                    )
            loss, m = policy_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.loss_mask,
                cfg,
                n_tokens=denom,
                n_sequences=max(n_seqs, 1.0),
                ref_logp=ref,
                entropy=entropy,
            )
            loss.backward()
            here = float(batch.loss_mask.sum())
            if here > 0:
                local["loss"] += float(loss.detach())
                for k in keys:
                    local[k] += m[k] * here / denom
                ratio_max = max(ratio_max, m["ratio_max"])

        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # SUM: every micro-batch loss is already divided by the global count
            if p.grad is None:  # a rank without samples still joins the collective
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = optimizer_step(self.optimizer, cfg, self.version)
        self.version += 1
        summed = dict(zip(local, self._all_reduce(list(local.values())), strict=True))
        (ratio_max,) = self._all_reduce([ratio_max], op=dist.ReduceOp.MAX)
        seconds = time.perf_counter() - t0
        return {
            **summed,
            "grad_norm": float(grad_norm),
            "tokens": n_tokens,
            "tokens_total": n_total,
            "train_seconds": seconds,
            "tokens_per_s": n_total / seconds if seconds else 0.0,
            "ratio_max": ratio_max,
            "world_size": float(self.dist.world_size),
            "lr": lr,
            "optimizer_resumed": float(self.optimizer_resumed),
            **advantage_stats(samples),
        }

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Rank 0 converts back to HF names and writes the untied directory. Collective."""
        if self.dist.rank == 0:
            from transformers import AutoConfig, GenerationConfig

            from trainer.hf_io import write_untied_hf
            from trainer.megatron_convert import from_local_spec, megatron_to_hf

            state = {
                k: v.detach().to("cpu", torch.float32)
                for k, v in self.model.state_dict().items()
                if not k.endswith("_extra_state")
            }
            if self._local_spec:
                state = from_local_spec(state)
            try:
                generation = GenerationConfig.from_pretrained(self.source_dir)
            except OSError:
                generation = None
            write_untied_hf(
                megatron_to_hf(state, self.hf_config),
                AutoConfig.from_pretrained(self.source_dir),
                generation,
                out_dir,
                tokenizer_dir,
            )
        dist.barrier()

    def save_optimizer(self, state_dir: Path) -> None:
        """Every rank holds the same AdamW state (data parallel only): rank 0 writes it."""
        if self.dist.rank == 0:
            state_dir = Path(state_dir)
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = state_dir / (OPTIMIZER_FILE + ".tmp")
            torch.save({"version": self.version, "state": self.optimizer.state_dict()}, tmp)
            tmp.replace(state_dir / OPTIMIZER_FILE)
        dist.barrier()

    def load_optimizer(self, state_dir: Path | None) -> bool:
        """Resume AdamW if `state_dir` holds the state for this version, else start fresh."""
        path = Path(state_dir) / OPTIMIZER_FILE if state_dir is not None else None
        saved = None
        if path is not None and path.is_file():
            saved = torch.load(path, map_location=self.dist.device, weights_only=True)
        ok = saved is not None and saved.get("version") == self.version
        (agreed,) = self._all_reduce([1.0 if ok else 0.0], op=dist.ReduceOp.MIN)
        if agreed:
            self.optimizer.load_state_dict(saved["state"])
        elif self.dist.rank == 0:
            logger.warning("fresh AdamW state for v%d: nothing usable at %s", self.version, path)
        self.optimizer_resumed = bool(agreed)
        return self.optimizer_resumed

    def close(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
