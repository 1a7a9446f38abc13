"""Token-exact training samples from the store, and their padded collation.

A sample is one completion: its prompt ids followed by the ids the backend
sampled. The loss mask is 1 exactly on the sampled ids; `old_logprobs` are
the behaviour logprobs the backend reported for them. Nothing is
re-tokenized from text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from gateway.store.models import Completion, Episode
from trainer.advantages import grpo_advantages


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]  # aligned with input_ids; 0.0 where loss_mask is 0
    advantage: float
    temperature: float
    policy_version: int


def sample_from_completion(c: Completion, advantage: float) -> Sample:
    prompt, out = list(c.prompt_token_ids), list(c.output_token_ids)
    return Sample(
        input_ids=prompt + out,
        loss_mask=[0] * len(prompt) + [1] * len(out),
        old_logprobs=[0.0] * len(prompt) + list(c.output_logprobs),
        advantage=advantage,
        temperature=c.temperature if c.temperature > 0 else 1.0,
        policy_version=c.policy_version,
    )


def load_step_samples(
    session: Session, run_id: str, step: int, adv_eps: float
) -> tuple[list[Sample], list[float], list[str]]:
    """Samples for the episodes the scheduler assigned to `step`, plus their rewards and groups."""
    episodes = (
        session.execute(
            select(Episode)
            .where(Episode.run_id == run_id, Episode.train_step == step)
            .order_by(Episode.group_id, Episode.id)
        )
        .scalars()
        .all()
    )
    rewards = [float(e.reward) for e in episodes]
    groups = [e.group_id for e in episodes]
    advantages = grpo_advantages(rewards, groups, eps=adv_eps)
    samples: list[Sample] = []
    for ep, adv in zip(episodes, advantages, strict=True):
        completions = session.execute(
            select(Completion)
            .where(Completion.run_id == run_id, Completion.episode_id == ep.id)
            .order_by(Completion.created_at)
        ).scalars()
        samples.extend(sample_from_completion(c, adv) for c in completions)
    return samples, rewards, groups


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on sampled tokens
    old_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T] the episode's advantage on every position
    temperature: torch.Tensor  # [B, 1]


def collate(samples: list[Sample], pad_id: int) -> Batch:
    width = max(len(s.input_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    old = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    temp = torch.ones((b, 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        adv[i, :n] = s.advantage
        temp[i, 0] = s.temperature
    return Batch(ids, attn, mask, old, adv, temp)
