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
4. Clip the global grad norm (over DTensor shards), AdamW step at the
   schedule's learning rate for this version.

The loss is `trainer.losses.policy.policy_loss`, the one `LocalEngine` uses,
so the KL penalty and the entropy bonus work here too: the frozen reference
(the run's base model) is sharded like the policy but never trained, and
its logprobs are computed without grad at the same trained positions.
AdamW's moments survive from one step (one torchrun process group) to the
next through `trainer.fsdp_checkpoint` when the run sets `save_optimizer_state`.

Logprobs follow `LocalEngine.token_logprobs`: the head is applied only at
positions whose next token is trained. `PolicyLogits` wraps the HF model so
that this selection happens inside the FSDP root's forward, which is what
gathers the embedding, final norm and head.
"""

from __future__ import annotations

import logging
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
from trainer.engine import learning_rate, optimizer_step
from trainer.fsdp_checkpoint import load_optimizer_state, save_optimizer_state
from trainer.hf_io import write_untied_hf
from trainer.losses.policy import policy_loss
from trainer.packing import greedy_pack_groups, pack, padded_groups, trainable_batch
from trainer.parallel import (
    DTYPES,
    apply_activation_checkpointing,
    apply_fsdp,
    init_distributed,
)

logger = logging.getLogger(__name__)

# per-micro-batch means of the loss's metrics, weighted back to a global mean
METRIC_KEYS = ("clip_frac", "approx_kl", "ratio_mean", "iw_mean", "entropy")


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
    *,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[B, T] logprob of input_ids[:, t] at its temperature where loss_mask is 1; 0 elsewhere.

    `with_entropy`: also the [B, T] entropy of the tempered distribution at the
    same positions (from the full logits row, as `LocalEngine` computes it).
    """
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
    out = torch.cat([torch.zeros_like(out[:, :1]), out], dim=1)
    if not with_entropy:
        return out
    ent = torch.zeros_like(out[:, 1:])
    ent[select] = -(logp.exp() * logp).sum(-1)
    return out, torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)


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
        reference_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.parallel = parallel or ParallelConfig()
        self.version = version
        self.dist = init_distributed(self.parallel.backend)
        torch.manual_seed(cfg.seed + version)
        self.compute_dtype = DTYPES[self.parallel.param_dtype]
        self.policy = self._sharded(checkpoint_dir, train=True)
        self.pad_id = self.policy.lm.config.pad_token_id or 0
        self.reference: PolicyLogits | None = None
        if cfg.kl_coef > 0:  # the frozen base model, for the KL penalty
            if reference_dir is None:
                raise ValueError("kl_coef > 0 needs the reference model's directory")
            self.reference = self._sharded(reference_dir, train=False)
        self.optimizer = torch.optim.AdamW(  # the schedule is a function of the version
            self.policy.parameters(), lr=learning_rate(cfg, version), weight_decay=cfg.weight_decay
        )
        self.optimizer_resumed = False

    def _sharded(self, model_dir: Path, *, train: bool) -> PolicyLogits:
        """An HF directory loaded on every rank, wrapped in PolicyLogits and fully sharded.

        The frozen reference (train=False) is sharded too, so it costs each
        rank 1/world of its weights; it never needs gradients or checkpointing.
        """
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=self.parallel.attn_implementation
        )
        model = PolicyLogits(lm).to(self.dist.device)
        model.train(train)
        model.requires_grad_(train)
        if train and self.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(
            model,
            self.dist.mesh,
            param_dtype=self.compute_dtype,
            reduce_dtype=DTYPES[self.parallel.reduce_dtype],
            reshard_after_forward=self.parallel.reshard_after_forward,
            gradient_divide_factor=1.0,  # the loss already divides by the global token count
        )
        return model

    def load_optimizer(self, state_dir: Path | None) -> bool:
        """Resume AdamW from `state_dir` if it holds the state for this version. Collective."""
        self.optimizer_resumed = load_optimizer_state(
            self.policy, self.optimizer, state_dir, self.version
        )
        return self.optimizer_resumed

    def save_optimizer(self, state_dir: Path) -> None:
        """Save AdamW's sharded state for the version just trained. Collective."""
        save_optimizer_state(self.policy, self.optimizer, state_dir, self.version)

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.dist.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _forward(
        self, chunk: list[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Batch]:
        """[S, L] logprobs, entropy and reference logprobs (or None) of `chunk` in its padded
        layout, and that layout's loss-side tensors."""
        dev = self.dist.device
        if self.parallel.packing:
            pb = pack(chunk, self.pad_id, self.compute_dtype)
            batch, pos = pb.padded, pb.position_ids
            model_in = (pb.input_ids, pb.attention_mask, pb.loss_mask, pb.temperatures)
        else:
            batch, pos = trainable_batch(collate(chunk, self.pad_id)), None
            model_in = (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperatures)
        ids, attn, mask, temps = (t.to(dev) for t in model_in)
        pos = pos if pos is None else pos.to(dev)
        logp, entropy = token_logprobs(self.policy, ids, attn, pos, mask, temps, with_entropy=True)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, ids, attn, pos, mask, temps)
        if self.parallel.packing:
            logp, entropy = pb.unpack(logp), pb.unpack(entropy)
            ref = ref if ref is None else pb.unpack(ref)
        return logp, entropy, ref, Batch(*(getattr(batch, f.name).to(dev) for f in fields(batch)))

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
        keys = (*METRIC_KEYS, "kl_ref") if self.reference is not None else METRIC_KEYS
        local = dict.fromkeys(("loss", *keys), 0.0)
        ratio_max = 0.0
        for i in range(int(n_micro)):
            real = i < len(groups)
            logp, entropy, ref_logp, batch = self._forward(groups[i] if real else [dummy])
            # n_tokens / n_sequences are the global counts: one denominator for every rank
            loss, m = policy_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.loss_mask,
                cfg,
                n_tokens=denom,
                n_sequences=max(n_seqs, 1.0),
                ref_logp=ref_logp,
                entropy=entropy,
            )
            loss.backward()
            here = float(batch.loss_mask.sum())
            if real and here > 0:
                local["loss"] += float(loss.detach())
                for k in keys:
                    local[k] += m[k] * here / denom
                ratio_max = max(ratio_max, m["ratio_max"])

        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
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
            # every real position is forwarded and back-propagated, prompt included
            "tokens_per_s": n_total / seconds if seconds else 0.0,
            "ratio_max": ratio_max,
            "micro_batches": n_micro,
            "world_size": float(self.dist.world_size),
            "lr": lr,
            "optimizer_resumed": float(self.optimizer_resumed),
        }

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Gather the full weights to rank 0 and write an untied HF directory atomically.

        Collective: every rank must call it. Rank 0 writes `out_dir.tmp`, then
        renames; the barrier keeps other ranks from returning before that.
        """
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.policy, options=opts)  # empty on ranks > 0
        if self.dist.rank == 0:
            lm = self.policy.lm
            state = {k.removeprefix("lm."): v for k, v in state.items()}
            write_untied_hf(state, lm.config, lm.generation_config, out_dir, tokenizer_dir)
        dist.barrier()

    def close(self) -> None:
        """Leave the process group together (the engine is unusable afterwards).

        The barrier first: gloo can abort a rank whose peers have already torn
        their connections down.
        """
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
