"""Assemble token-exact training sequences from an episode's conversation tree.

A turn whose prompt was spliced (its prompt ids begin with the parent's
prompt ids followed by the parent's sampled ids) continues the parent's
sequence, so a chain of spliced turns trains as ONE sequence: the last
turn's prompt ids + sampled ids, with the loss mask on every span that some
turn sampled. A turn whose history the chat template rendered differently
from what was sampled (drift) starts a sequence of its own.

In a branching tree every leaf yields a sequence, and each sampled token is
trained exactly once: a span shared by several branches is trained in the
first (oldest) branch and is plain context in the others.

Orphaned retries (an earlier completion with the same prompt as a later one
in the same episode, and no turns built on it) are excluded by default: the
agent threw that answer away.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from trainer.batch import Sample


@dataclass(frozen=True)
class Turn:
    id: str
    parent_id: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    temperature: float
    policy_version: int  # the oldest version among its tokens (each logprob is its own token's)
    spliced: bool
    prompt_hash: str | None
    created_order: int  # position by creation time within the episode


@dataclass
class AssemblyStats:
    sequences: int = 0
    drift_segments: int = 0
    orphans_excluded: int = 0
    turns_without_advantage: int = 0
    notes: list[str] = field(default_factory=list)


def orphaned_retries(turns: list[Turn]) -> set[str]:
    """Ids of turns retried later with the same prompt and left without continuation."""
    has_child = {t.parent_id for t in turns if t.parent_id}
    latest: dict[str, int] = {}
    for t in turns:
        if t.prompt_hash:
            latest[t.prompt_hash] = max(latest.get(t.prompt_hash, -1), t.created_order)
    return {
        t.id
        for t in turns
        if t.prompt_hash and t.created_order < latest[t.prompt_hash] and t.id not in has_child
    }


def assemble(
    turns: list[Turn],
    advantages: dict[str, float | None],
    *,
    train_orphans: bool = False,
    stats: AssemblyStats | None = None,
) -> list[Sample]:
    """Training samples for one episode. `advantages[id]` None: the turn's tokens are context."""
    stats = stats if stats is not None else AssemblyStats()
    by_id = {t.id: t for t in turns}
    excluded = set() if train_orphans else orphaned_retries(turns)
    stats.orphans_excluded += len(excluded)
    stats.turns_without_advantage += sum(1 for t in turns if advantages.get(t.id) is None)
    continues: dict[str, str] = {}  # child id -> parent id, for spliced links only
    spliced_children: dict[str, list[str]] = defaultdict(list)
    for t in turns:
        if t.spliced and t.parent_id in by_id:
            continues[t.id] = t.parent_id
            spliced_children[t.parent_id].append(t.id)
        elif t.parent_id in by_id:
            stats.drift_segments += 1
    leaves = sorted((t for t in turns if not spliced_children[t.id]), key=lambda t: t.created_order)
    trained: set[str] = set()
    samples: list[Sample] = []
    for leaf in leaves:
        ids = leaf.prompt_token_ids + leaf.output_token_ids
        n = len(ids)
        mask, old, adv, temp = [0] * n, [0.0] * n, [0.0] * n, [1.0] * n
        versions: list[int] = []
        node: Turn | None = leaf
        while node is not None:
            start = len(node.prompt_token_ids)
            end = start + len(node.output_token_ids)
            if ids[:end] != node.prompt_token_ids + node.output_token_ids:
                raise ValueError(f"turn {node.id} is not a prefix of {leaf.id}: splice broken")
            a = advantages.get(node.id)
            if node.id not in trained and node.id not in excluded and a is not None:
                trained.add(node.id)
                t_eff = node.temperature if node.temperature > 0 else 1.0
                mask[start:end] = [1] * (end - start)
                old[start:end] = node.output_logprobs
                adv[start:end] = [a] * (end - start)
                temp[start:end] = [t_eff] * (end - start)
                versions.append(node.policy_version)
            parent = continues.get(node.id)
            node = by_id[parent] if parent else None
        if versions:  # a sequence with nothing left to train is not worth a forward pass
            samples.append(Sample(ids, mask, old, adv, temp, min(versions)))
            stats.sequences += 1
    return samples
