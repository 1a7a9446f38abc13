"""Token-exact training samples and their padded collation.

A sample is one token sequence the model saw: prompt ids followed by the ids
the backend sampled (for a multi-turn episode, several turns spliced into
one sequence, see `trainer.sequences`). The loss mask is 1 exactly on
sampled ids; `old_logprobs`, `advantages` and `temperatures` are per
position and meaningful only where the mask is 1. Nothing is re-tokenized
from text.

A completion sampled across a keep-mode hot swap holds tokens of several
versions (`Completion.version_starts`). Each token's `old_logprobs` entry is
the logprob its own version reported, so the loss's ratio is per token
against whichever version sampled it; `min_version` is the oldest token's
(a completion's `policy_version`), the one staleness counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sqlalchemy.orm import Session

from core.store.completions import episode_completions_sync
from core.store.episodes import step_episodes_sync
from core.store.models import Completion
from core.store.rewards import latest_episode_reward_sync
from trainer.advantages import group_advantage
from trainer.config import RunConfig

if TYPE_CHECKING:
    from trainer.sequences import AssemblyStats


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on sampled tokens that this sample trains
    old_logprobs: list[float]  # behaviour logprobs; 0.0 off the mask
    advantages: list[float]  # 0.0 off the mask
    temperatures: list[float]  # sampling temperature of each token; 1.0 off the mask
    min_version: int  # oldest policy version among the trained tokens (each turn's first)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "old_logprobs", "advantages", "temperatures"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")


def sample_from_completion(c: Completion, advantage: float) -> Sample:
    """One completion on its own: its prompt ids, then its sampled ids (trained)."""
    prompt, out = list(c.prompt_token_ids), list(c.output_token_ids)
    temp = c.temperature if c.temperature > 0 else 1.0
    return Sample(
        input_ids=prompt + out,
        loss_mask=[0] * len(prompt) + [1] * len(out),
        old_logprobs=[0.0] * len(prompt) + list(c.output_logprobs),
        advantages=[0.0] * len(prompt) + [advantage] * len(out),
        temperatures=[1.0] * len(prompt) + [temp] * len(out),
        min_version=c.policy_version,
    )


def load_step_samples(
    session: Session, run_id: str, step: int, cfg: RunConfig
) -> tuple[list[Sample], list[float], list[str], AssemblyStats]:
    """Samples for the episodes the scheduler assigned to `step`.

    Returns (samples, episode returns, group ids, assembly stats). Imports of
    the assembly helpers are local: `trainer.sequences` builds on `Sample`.
    """
    from trainer.returns import Node, completion_returns, episode_return
    from trainer.sequences import AssemblyStats, Turn, assemble

    episodes = step_episodes_sync(session, run_id, step)
    trees: dict[str, list[Completion]] = {
        ep.id: episode_completions_sync(session, run_id, [ep.id]) for ep in episodes
    }
    explicit = {ep.id: latest_episode_reward_sync(session, run_id, ep.id) for ep in episodes}
    nodes = {ep.id: [Node(c.id, c.parent_id, c.reward) for c in trees[ep.id]] for ep in episodes}
    returns = {
        ep.id: episode_return(nodes[ep.id], explicit[ep.id], cfg.reward_policy, cfg.gamma)
        for ep in episodes
    }
    by_group: dict[str, list[float]] = {}
    for ep in episodes:
        by_group.setdefault(ep.group_id, []).append(returns[ep.id])
    stats = AssemblyStats()
    samples: list[Sample] = []
    for ep in episodes:
        g = completion_returns(nodes[ep.id], explicit[ep.id], cfg.reward_policy, cfg.gamma)
        group = by_group[ep.group_id]
        # a cancelled (client hung up) completion is context, never trained
        cancelled = {c.id for c in trees[ep.id] if c.finish_reason == "cancelled"}
        adv = {
            k: None
            if v is None or k in cancelled
            else group_advantage(v, group, cfg.advantage_estimator, cfg.adv_eps)
            for k, v in g.items()
        }
        turns = [
            Turn(
                id=c.id,
                parent_id=c.parent_id,
                prompt_token_ids=list(c.prompt_token_ids),
                output_token_ids=list(c.output_token_ids),
                output_logprobs=list(c.output_logprobs),
                temperature=c.temperature,
                policy_version=c.policy_version,
                spliced=bool(c.spliced),
                prompt_hash=c.prompt_hash,
                created_order=i,
            )
            for i, c in enumerate(trees[ep.id])
        ]
        samples.extend(assemble(turns, adv, train_orphans=cfg.train_orphans, stats=stats))
    return samples, [returns[ep.id] for ep in episodes], [ep.group_id for ep in episodes], stats


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on sampled tokens
    old_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T]
    temperatures: torch.Tensor  # [B, T]


def collate(samples: list[Sample], pad_id: int) -> Batch:
    width = max(len(s.input_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    old = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    temp = torch.ones((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        adv[i, :n] = torch.tensor(s.advantages, dtype=torch.float32)
        temp[i, :n] = torch.tensor(s.temperatures, dtype=torch.float32)
    return Batch(ids, attn, mask, old, adv, temp)
