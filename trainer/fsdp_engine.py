"""FSDP2 training engine: the `LocalEngine` step and save, run on every rank of a process group.

One optimizer step, read top to bottom (`FsdpEngine.step`):

1. Each rank takes its shard of the samples (longest first to the least
   loaded rank), then cuts it into micro-batches: packed rows up to
   `pack_tokens` tokens (`trainer.packing`) or padded groups of
   `micro_batch_size` (`trainer.batch.collate`).
2. The trained-token count and the sample count are all-reduced FIRST, so
   every micro-batch on every rank divides by the same global denominator:
   sum over ranks of the local losses is then exactly the single-process
   loss, and FSDP's reduce-scatter must SUM gradients (divide factor 1),
   not average them.
3. Ranks run the same number of micro-batches (FSDP all-gathers per layer
   are collectives): a rank that runs out does a zero-weight dummy pass.
4. Clip the global grad norm (over DTensor shards), AdamW step.

Logprobs follow `LocalEngine.token_logprobs`: the head is applied only at
positions whose next token is trained. `PolicyLogits` wraps the HF model so
that this selection happens inside the FSDP root's forward, which is what
gathers the embedding, final norm and head.
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from trainer.batch import Batch, Sample, collate
from trainer.config import ParallelConfig, RunConfig
from trainer.engine import TOKENIZER_FILES, learning_rate
from trainer.losses.ppo import ppo_clip_loss
from trainer.packing import greedy_pack_groups, pack, padded_groups, trainable_batch
from trainer.parallel import (
    DTYPES,
    apply_activation_checkpointing,
    apply_fsdp,
    init_distributed,
)

METRIC_KEYS = ("clip_frac", "approx_kl", "ratio_mean")


class PolicyLogits(nn.Module):
    """FSDP root: the LM trunk over every position, the LM head only where `select` is true."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, select) -> torch.Tensor:
        # use_cache=False: a KV cache is useless in training, and a checkpointed layer's
        # recompute would append to it a second time
        hidden = self.lm.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return self.lm.get_output_embeddings()(hidden[:, :-1][select])


def token_logprobs(
    policy: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    loss_mask: torch.Tensor,
    temperatures: torch.Tensor,
) -> torch.Tensor:
    """[B, T] logprob of input_ids[:, t] at its temperature where loss_mask is 1; 0 elsewhere."""
    select = loss_mask[:, 1:] > 0
    if not select.any():
        # Keep the head in the graph (its loss weight is 0 through the mask): with FSDP
        # every rank must produce a gradient for every parameter, or the collectives differ.
        select = torch.zeros_like(select)
        select[0, 0] = True
    logits = policy(input_ids, attention_mask, position_ids, select).float()
    temps = temperatures[:, 1:][select]
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:][select][:, None]).squeeze(-1)
    out = torch.zeros(select.shape, dtype=picked.dtype, device=picked.device)
    out[select] = picked
    return torch.cat([torch.zeros_like(out[:, :1]), out], dim=1)


def shard_for_rank(samples: list[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's samples: longest first to the least-loaded rank, then back in input order."""
    load = [0] * world_size
    owner = [0] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += len(samples[i].input_ids)
    return [s for s, r in zip(samples, owner, strict=True) if r == rank]


def _trained(s: Sample) -> int:
    return sum(s.loss_mask[1:])  # position 0 has no predecessor, see trainer.packing


class FsdpEngine:
    def __init__(
        self,
        checkpoint_dir: Path,
        version: int,
        cfg: RunConfig,
        parallel: ParallelConfig | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.parallel = parallel or ParallelConfig()
        self.version = version
        self.dist = init_distributed(self.parallel.backend)
        torch.manual_seed(cfg.seed + version)
        lm = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir,
            dtype=torch.float32,
            attn_implementation=self.parallel.attn_implementation,
        )
        self.pad_id = lm.config.pad_token_id or 0
        self.compute_dtype = DTYPES[self.parallel.param_dtype]
        self.policy = PolicyLogits(lm).to(self.dist.device)
        self.policy.train()
        if self.parallel.activation_checkpointing:
            apply_activation_checkpointing(self.policy)
        apply_fsdp(
            self.policy,
            self.dist.mesh,
            param_dtype=self.compute_dtype,
            reduce_dtype=DTYPES[self.parallel.reduce_dtype],
            reshard_after_forward=self.parallel.reshard_after_forward,
            gradient_divide_factor=1.0,  # the loss already divides by the global token count
        )
        self.optimizer = torch.optim.AdamW(  # the schedule is a function of the version
            self.policy.parameters(), lr=learning_rate(cfg, version), weight_decay=cfg.weight_decay
        )

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.dist.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _forward(self, chunk: list[Sample]) -> tuple[torch.Tensor, Batch]:
        """[S, L] logprobs of `chunk` in its padded layout, and that layout's loss-side tensors."""
        dev = self.dist.device
        if self.parallel.packing:
            pb = pack(chunk, self.pad_id, self.compute_dtype)
            batch, pos = pb.padded, pb.position_ids
            model_in = (pb.input_ids, pb.attention_mask, pb.loss_mask, pb.temperatures)
        else:
            batch, pos = trainable_batch(collate(chunk, self.pad_id)), None
            model_in = (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperatures)
        ids, attn, mask, temps = (t.to(dev) for t in model_in)
        logp = token_logprobs(
            self.policy, ids, attn, pos if pos is None else pos.to(dev), mask, temps
        )
        if self.parallel.packing:
            logp = pb.unpack(logp)
        return logp, Batch(*(getattr(batch, f.name).to(dev) for f in fields(batch)))

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over all ranks' samples, one global denominator."""
        t0 = time.perf_counter()
        cfg, par = self.cfg, self.parallel
        mine = shard_for_rank(samples, self.dist.rank, self.dist.world_size)
        if par.packing:
            groups = greedy_pack_groups(mine, par.pack_tokens)
        else:
            groups = padded_groups(mine, cfg.micro_batch_size)
        n_tokens, n_seqs, n_total = self._all_reduce(
            [sum(map(_trained, mine)), len(mine), sum(len(s.input_ids) for s in mine)]
        )
        (n_micro,) = self._all_reduce([len(groups)], op=dist.ReduceOp.MAX)
        denom = max(n_tokens, 1.0)
        dummy = Sample([self.pad_id] * 2, [0, 0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], 0)

        self.optimizer.zero_grad(set_to_none=True)
        local = dict.fromkeys(("loss", *METRIC_KEYS), 0.0)
        ratio_max = 0.0
        for i in range(int(n_micro)):
            real = i < len(groups)
            logp, batch = self._forward(groups[i] if real else [dummy])
            loss, m = ppo_clip_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.loss_mask,
                clip_eps_low=cfg.clip_eps_low,
                clip_eps_high=cfg.clip_eps_high,
                # Dr.GRPO's constant normaliser: sequences x token budget, like policy_loss
                normaliser=(
                    max(n_seqs, 1.0) * (cfg.constant_normaliser or 1)
                    if cfg.loss_agg == "constant"
                    else denom
                ),
                agg=cfg.loss_agg,
                seq_weight=max(n_seqs, 1.0),
                behaviour_weight_cap=cfg.behaviour_weight_cap,
            )
            loss.backward()
            here = float(batch.loss_mask.sum())
            if real and here > 0:
                local["loss"] += float(loss.detach())
                for k in METRIC_KEYS:  # per-micro-batch means, weighted back to a global mean
                    local[k] += m[k] * here / denom
                ratio_max = max(ratio_max, m["ratio_max"])

        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
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
            # every real position is forwarded and back-propagated, prompt included
            "tokens_per_s": n_total / seconds if seconds else 0.0,
            "ratio_max": ratio_max,
            "micro_batches": n_micro,
            "world_size": float(self.dist.world_size),
        }

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Gather the full weights to rank 0 and write an untied HF directory atomically.

        Collective: every rank must call it. Rank 0 writes `out_dir.tmp`, then
        renames; the barrier keeps other ranks from returning before that.
        """
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.policy, options=opts)  # empty on ranks > 0
        if self.dist.rank == 0:
            out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
            state = {k.removeprefix("lm."): v for k, v in state.items()}
            # a tied source model gets an explicit head (vLLM's in-place reload skips tied ones)
            head, emb = "lm_head.weight", "model.embed_tokens.weight"
            if head not in state or state[head].data_ptr() == state[emb].data_ptr():
                state[head] = state[emb].clone()
            tmp = out_dir.with_name(out_dir.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            self._untied_shell().save_pretrained(tmp, state_dict=state)
            for name in TOKENIZER_FILES:
                src = tokenizer_dir / name
                if src.is_file() and not (tmp / name).exists():
                    shutil.copy2(src, tmp / name)
            shutil.rmtree(out_dir, ignore_errors=True)
            tmp.rename(out_dir)
        dist.barrier()

    def _untied_shell(self) -> nn.Module:
        """An untied copy of the model's architecture on the meta device, for save_pretrained.

        The live model cannot save itself untied: its modules are FSDP-wrapped
        and a tied source model shares one parameter between embedding and head.
        """
        from transformers import AutoModelForCausalLM

        lm = self.policy.lm
        config = copy.deepcopy(lm.config)
        config.tie_word_embeddings = False
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        shell.generation_config = copy.deepcopy(lm.generation_config)
        return shell

    def close(self) -> None:
        """Leave the process group together (the engine is unusable afterwards).

        The barrier first: gloo can abort a rank whose peers have already torn
        their connections down.
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
