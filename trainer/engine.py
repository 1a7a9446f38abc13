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
from trainer.losses.policy import policy_loss

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def learning_rate(cfg: RunConfig, version: int) -> float:
    """Linear warm-up over the first `lr_warmup_steps` steps, then constant.

    A function of the version (= the step), so a restarted worker resumes the schedule.
    """
    if cfg.lr_warmup_steps <= 0:
        return cfg.learning_rate
    return cfg.learning_rate * min(1.0, (version + 1) / cfg.lr_warmup_steps)


def optimizer_step(optimizer: torch.optim.Optimizer, cfg: RunConfig, version: int) -> float:
    """Step at the schedule's learning rate for `version`; returns that rate.

    The rate is set on every param group first: a resumed optimizer state carries the
    rate of the step it was saved at.
    """
    lr = learning_rate(cfg, version)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return lr


def advantage_stats(samples: list[Sample]) -> dict[str, float]:
    values = [a for s in samples for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]
    if not values:
        return {}
    t = torch.tensor(values)
    return {
        "adv_mean": float(t.mean()),
        "adv_std": float(t.std(unbiased=False)),
        "adv_min": float(t.min()),
        "adv_max": float(t.max()),
    }


class LocalEngine:
    def __init__(
        self,
        checkpoint_dir: Path,
        version: int,
        cfg: RunConfig,
        reference_dir: Path | None = None,
    ) -> None:
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
        self.reference = None
        if cfg.kl_coef > 0:  # the frozen base model, for the KL penalty
            if reference_dir is None:
                raise ValueError("kl_coef > 0 needs the reference model's directory")
            self.reference = AutoModelForCausalLM.from_pretrained(
                reference_dir, dtype=torch.float32
            ).eval()
            self.reference.requires_grad_(False)

    def token_logprobs(self, batch, model=None) -> torch.Tensor:
        """[B, T] logprobs of input_ids[:, t] under the model at temperature; 0 off the mask."""
        return self._logprobs_and_entropy(batch, model or self.model)[0]

    def _logprobs_and_entropy(self, batch, model) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of the targets and entropy of the distribution, at trained positions."""
        hidden = model.base_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
        targets = batch.input_ids[:, 1:]
        where = batch.loss_mask[:, 1:] > 0
        temps = batch.temperatures[:, 1:][where]
        logits = model.get_output_embeddings()(hidden[:, :-1][where]).float()
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        picked = logp.gather(-1, targets[where][:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        out, ent_out = torch.zeros(targets.shape), torch.zeros(targets.shape)
        out[where], ent_out[where] = picked.to(out.dtype), ent.to(out.dtype)
        pad = torch.zeros_like(out[:, :1])
        return torch.cat([pad, out], dim=1), torch.cat([pad, ent_out], dim=1)

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step over all samples, in micro-batches sharing one denominator."""
        t0 = time.perf_counter()
        cfg = self.cfg
        n_tokens = sum(sum(s.loss_mask) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, ratio_max = 0.0, 0.0
        sums = dict.fromkeys(("clip_frac", "approx_kl", "ratio_mean", "iw_mean", "entropy"), 0.0)
        if cfg.kl_coef > 0:
            sums["kl_ref"] = 0.0
        for start in range(0, len(samples), cfg.micro_batch_size):
            chunk = samples[start : start + cfg.micro_batch_size]
            batch = collate(chunk, self.pad_id)
            logp, entropy = self._logprobs_and_entropy(batch, self.model)
            ref_logp = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = self.token_logprobs(batch, self.reference)
            loss, m = policy_loss(
                logp,
                batch.old_logprobs,
                batch.advantages,
                batch.loss_mask,
                cfg,
                n_tokens=n_tokens,
                n_sequences=len(samples),
                ref_logp=ref_logp,
                entropy=entropy,
            )
            loss.backward()
            total_loss += float(loss.detach())
            weight = float(batch.loss_mask.sum()) / max(n_tokens, 1)
            for k in sums:
                sums[k] += m[k] * weight
            ratio_max = max(ratio_max, m["ratio_max"])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        lr = optimizer_step(self.optimizer, cfg, self.version)
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
            "lr": lr,
            **advantage_stats(samples),
            **sums,
        }

    def save_optimizer(self, path: Path) -> None:
        """AdamW state for the version just trained (overwritten each step, atomically)."""
        tmp = path.with_suffix(".tmp")
        torch.save({"version": self.version, "state": self.optimizer.state_dict()}, tmp)
        tmp.replace(path)

    def load_optimizer(self, path: Path) -> bool:
        """Resume AdamW's moments if `path` holds them for this engine's version."""
        if not path.is_file():
            logger.warning("no optimizer state at %s: fresh AdamW for v%d", path, self.version)
            return False
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("version") != self.version:
            logger.warning(
                "optimizer state is for v%s, not v%d: fresh AdamW",
                saved.get("version"),
                self.version,
            )
            return False
        self.optimizer.load_state_dict(saved["state"])
        return True

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
