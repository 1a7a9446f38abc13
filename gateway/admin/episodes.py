"""Episodes for the admin API and dashboard: filtered lists and a token-level detail view.

The detail shows each completion's prompt and sampled tokens decoded one by
one, with the behaviour logprob of every sampled token and whether the loss
was taken on it. The loss mask follows the trainer's: sampled tokens only,
never the prompt (which includes tool results and earlier turns); a sampled
token counts as trained once its episode reached status "trained".
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.completions import episode_completions, turn_stats
from core.store.episodes import episode_page, episode_reward_posts, episode_shapes, group_members
from core.store.models import Completion, Episode, Run, as_utc
from core.store.status import EpisodeStatus
from gateway.admin import group_advantages
from gateway.errors import InvalidRequest, NotFound
from gateway.protocol_admin import (
    CompletionDetail,
    EpisodeDetail,
    EpisodePage,
    EpisodeQuery,
    EpisodeSummary,
    GroupDetail,
    TokenView,
)
from gateway.rows import from_row
from trainer.config import RunConfig


class TokenDecoder:
    """One tokenizer per model directory, loaded off the event loop on first use."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    async def get(self, model_dir: str) -> Any:
        async with self._lock:
            if model_dir not in self._tokenizers:
                from transformers import AutoTokenizer  # heavy: only when a detail is asked

                self._tokenizers[model_dir] = await asyncio.to_thread(
                    AutoTokenizer.from_pretrained, Path(model_dir)
                )
            return self._tokenizers[model_dir]


def _pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


class EpisodeAdmin:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions
        self.decoder = TokenDecoder()

    async def list(self, run_id: str, q: EpisodeQuery) -> EpisodePage:
        """One page of the query `q`, newest first (`EpisodeQuery`)."""
        if q.reward_min is not None and q.reward_max is not None and q.reward_min > q.reward_max:
            raise InvalidRequest("reward_min is above reward_max", param="reward_min")
        if q.length_min is not None and q.length_max is not None and q.length_min > q.length_max:
            raise InvalidRequest("length_min is above length_max", param="length_min")
        async with self.sessions() as s:
            if await s.get(Run, run_id) is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            anchor = None
            if q.after is not None:
                anchor = await s.get(Episode, (run_id, q.after))
                if anchor is None:
                    raise InvalidRequest(f"no episode {q.after!r} to page after", param="after")
            episodes = await episode_page(
                s,
                run_id,
                q.episodes(),
                limit=q.limit + 1,  # one more says whether a next page exists
                newest_first=True,
                after=(anchor.created_at, anchor.id) if anchor else None,
            )
            more = len(episodes) > q.limit
            summaries = await _summaries(s, run_id, episodes[: q.limit])
        return EpisodePage(data=list(summaries.values()), has_more=more)

    async def group(self, run_id: str, group_id: str) -> GroupDetail:
        """The group's episodes, oldest first, with returns and advantages per turn."""
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            members = await group_members(s, run_id, group_id)
            if not members:
                raise NotFound(f"no group {group_id!r} in run {run_id!r}", param="group_id")
            ids = [e.id for e in members]
            summaries = await _summaries(s, run_id, members)
            turns: dict[str, list[Completion]] = defaultdict(list)
            for c in await episode_completions(s, run_id, ids):
                turns[c.episode_id].append(c)
            posts = await episode_reward_posts(s, run_id, ids)
        cfg = RunConfig.model_validate(run.config)
        return GroupDetail(
            run_id=run_id,
            group_id=group_id,
            advantage_estimator=cfg.advantage_estimator,
            reward_policy=cfg.reward_policy,
            episodes=await asyncio.to_thread(
                group_advantages.group_members, cfg, members, summaries, turns, posts
            ),
        )

    async def detail(self, run_id: str, episode_id: str) -> EpisodeDetail:
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            ep = await s.get(Episode, (run_id, episode_id))
            if ep is None:
                raise NotFound(f"no episode {episode_id!r} in run {run_id!r}", param="episode_id")
            completions = await episode_completions(s, run_id, [episode_id])
        tokenizer = await self.decoder.get(run.model_path)
        trained = ep.status == EpisodeStatus.TRAINED
        details = await asyncio.to_thread(
            lambda: [_completion(tokenizer, c, trained, run.policy) for c in completions]
        )
        versions = sorted({v for c in completions for _, v in c.spans})
        sampled = sum(len(c.output_token_ids) for c in completions)
        drift = any(c.drift for c in completions)
        summary = _summary(ep, len(completions), versions, sampled, drift)
        return EpisodeDetail(**summary.model_dump(), completions=details)


async def _summaries(
    session: AsyncSession, run_id: str, episodes: list[Episode]
) -> dict[str, EpisodeSummary]:
    """Episode id -> its summary, in the order given."""
    ids = [e.id for e in episodes]
    stats = await turn_stats(session, run_id, ids)
    shapes = await episode_shapes(session, run_id, ids)
    return {
        e.id: _summary(e, *stats.get(e.id, (0, [])), *shapes.get(e.id, (0, False)))
        for e in episodes
    }


def _summary(
    ep: Episode, turns: int, versions: list[int], sampled_tokens: int = 0, drift: bool = False
) -> EpisodeSummary:
    return from_row(
        EpisodeSummary,
        ep,
        episode_id=ep.id,
        turns=turns,
        versions=versions,
        created_at=as_utc(ep.created_at).isoformat(),
        sampled_tokens=sampled_tokens,
        drift=drift,
    )


def _completion(
    tokenizer: Any, c: Completion, trained: bool, policy: str | None = None
) -> CompletionDetail:
    prompt_text = _pieces(tokenizer, c.prompt_token_ids)
    output_text = _pieces(tokenizer, c.output_token_ids)
    return from_row(
        CompletionDetail,
        c,
        completion_id=c.id,
        versions=[v for _, v in c.spans],
        drift=bool(c.drift),
        spliced=bool(c.spliced),
        loss_mask=[0] * len(c.prompt_token_ids) + [1] * len(c.output_token_ids),
        prompt_tokens=[
            TokenView(id=i, text=t, trained=False)
            for i, t in zip(c.prompt_token_ids, prompt_text, strict=True)
        ],
        output_tokens=[
            TokenView(id=i, text=t, logprob=lp, trained=trained, version=v)
            for i, t, lp, v in zip(
                c.output_token_ids, output_text, c.output_logprobs, c.token_versions(), strict=True
            )
        ],
        created_at=as_utc(c.created_at).isoformat(),
        policy=policy,
    )
