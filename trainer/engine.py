"""Single-process training engine: load a checkpoint, take PPO steps, save the next version.

Logits are computed only at the positions that predict a sampled token
(hidden state at t predicts token t+1), which keeps the [tokens, vocab]
logits tensor to the trained tokens instead of the whole sequence.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from trainer.batch import Sample, collate
from trainer.config import RunConfig
from trainer.losses.ppo import ppo_clip_loss

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class LocalEngine:
    def __init__(self, checkpoint_dir: Path, version: int, cfg: RunConfig) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(cfg.seed + version)
        self.cfg = cfg
        self.version = version
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )

    def token_logprobs(self, batch) -> torch.Tensor:
        """[B, T] logprobs of input_ids[:, t] under the model at temperature; 0 off the mask."""
        hidden = self.model.base_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
        targets = batch.input_ids[:, 1:]
        where = batch.loss_mask[:, 1:] > 0
        temps = batch.temperatures[:, 1:][where]
        logits = self.model.get_output_embeddings()(hidden[:, :-1][where]).float()
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        picked = logp.gather(-1, targets[where][:, None]).squeeze(-1)
        out = torch.zeros(targets.shape, dtype=picked.dtype)
        out[where] = picked
        return torch.cat([torch.zeros_like(out[:, :1]), out], dim=1)

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over all samples, in micro-batches sharing one denominator."""
        t0 = time.perf_counter()
        cfg = self.cfg
        n_tokens = sum(sum(s.loss_mask) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, sums = 0.0, {"clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
        ratio_max = 0.0
        for start in range(0, len(samples), cfg.micro_batch_size):
            chunk = samples[start : start + cfg.micro_batch_size]
            batch = collate(chunk, self.pad_id)
            logp = self.token_logprobs(batch)
            loss, m = ppo_clip_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.loss_mask,
                clip_eps_low=cfg.clip_eps_low,
                clip_eps_high=cfg.clip_eps_high,
                normaliser=float(max(n_tokens, 1)),
                agg=cfg.loss_agg,
                seq_weight=float(len(samples)),
            )
            loss.backward()
            total_loss += float(loss.detach())
            weight = float(batch.loss_mask.sum()) / max(n_tokens, 1)
            for k in sums:
                sums[k] += m[k] * weight
            ratio_max = max(ratio_max, m["ratio_max"])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        seconds = time.perf_counter() - t0
        return {
            "loss": total_loss,
            "grad_norm": float(grad_norm),
            "tokens": float(n_tokens),
            "tokens_total": float(sum(len(s.input_ids) for s in samples)),
            "train_seconds": seconds,
            # every position is forwarded and back-propagated, prompt included
            "tokens_per_s": sum(len(s.input_ids) for s in samples) / seconds if seconds else 0.0,
            "ratio_max": ratio_max,
            **sums,
        }

    def save(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Write an untied HF directory to `out_dir` atomically (temp dir, then rename)."""
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            src = tokenizer_dir / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
