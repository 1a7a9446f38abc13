"""Episode export: one record per episode with its completions, as JSON lines or Parquet.

Records are read a page of episodes at a time, each page in its own short
session, so an export of a large run neither holds all rows in memory nor
keeps a database connection open while the client reads. The price is that
an export is not a snapshot: an episode rewarded while the export runs may
appear with either status. Pages follow `(created_at, id)`, so every episode
that existed when the export started appears exactly once.

Parquet has a fixed schema (`PARQUET_SCHEMA`); `messages` is a JSON string
there, since chat messages have no single shape an Arrow struct could hold.

A completion's `policy_version` is its oldest token's version; `version_starts`
says where each later version began when a keep-mode swap happened while it
was sampled (null when every token is `policy_version`'s), the same in both
formats.

A run with policies (docs/policies.md) exports its policies' runs one after the
other: an episode that called two policies is two records with one `episode_id`,
each holding that policy's turns. Every record and completion names its `policy`
(null for a run without policies).

Every export is of one split: `train` (the default) holds the training episodes,
whatever their status, and never an evaluation episode; `eval` holds only the
evaluation episodes (`EpisodeStatus.EVAL`, sampled under `/eval`). Records of
both have the same shape, and each says its `split`.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.completions import episode_completions
from core.store.episodes import EpisodeFilter, episode_page
from core.store.models import Completion, Episode, as_utc
from core.store.runs import policy_runs
from core.store.status import EpisodeStatus

ExportFormat = Literal["jsonl", "parquet"]
ExportSplit = Literal["train", "eval"]

JSONL_MEDIA_TYPE = "application/x-ndjson"
PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"

_TIMESTAMP = pa.timestamp("us", tz="UTC")

COMPLETION_TYPE = pa.struct(
    [
        ("completion_id", pa.string()),
        ("parent_id", pa.string()),
        ("messages", pa.string()),  # JSON-encoded list of chat messages
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("output_logprobs", pa.list_(pa.float32())),  # stored as float32; exported unchanged
        ("loss_mask", pa.list_(pa.int8())),
        ("content", pa.string()),
        ("finish_reason", pa.string()),
        ("temperature", pa.float64()),
        ("policy_version", pa.int64()),  # the oldest version among its tokens
        # [[token index, version], ...] where each version began; null: one version
        ("version_starts", pa.list_(pa.list_(pa.int64()))),
        ("reward", pa.float64()),
        ("created_at", _TIMESTAMP),
        ("policy", pa.string()),  # the policy that sampled it; null: a run without policies
    ]
)

PARQUET_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("policy", pa.string()),
        ("episode_id", pa.string()),
        ("group_id", pa.string()),
        ("status", pa.string()),
        ("split", pa.string()),  # "train" or "eval"
        ("reward", pa.float64()),
        ("train_step", pa.int64()),
        ("created_at", _TIMESTAMP),
        ("completions", pa.list_(COMPLETION_TYPE)),
    ]
)


@dataclass(frozen=True)
class ExportFilter:
    """Which episodes to export; `None` means no restriction."""

    status: EpisodeStatus | None = None
    # Only episodes all of whose completions were sampled by this policy version or a later one.
    min_version: int | None = None
    split: ExportSplit = "train"

    def episodes(self) -> EpisodeFilter:
        """The store's filter of the episodes this export holds."""
        held_out = self.split == "eval"
        return EpisodeFilter(status=self.status, min_version=self.min_version, held_out=held_out)

    def can_match(self) -> bool:
        """An evaluation episode's status is `eval` for life, and only theirs is: a status
        filter that names the other split's statuses matches nothing."""
        if self.status is None:
            return True
        return (self.status == EpisodeStatus.EVAL) == (self.split == "eval")


def episode_split(ep: Episode) -> ExportSplit:
    return "eval" if ep.held_out else "train"


def completion_record(c: Completion, policy: str | None = None) -> dict[str, Any]:
    return {
        "completion_id": c.id,
        "parent_id": c.parent_id,
        "messages": c.messages,
        "prompt_token_ids": c.prompt_token_ids,
        "output_token_ids": c.output_token_ids,
        "output_logprobs": c.output_logprobs,
        # Over prompt + output: the trainer takes its loss on the sampled tokens only.
        "loss_mask": [0] * len(c.prompt_token_ids) + [1] * len(c.output_token_ids),
        "content": c.content,
        "finish_reason": c.finish_reason,
        "temperature": c.temperature,
        "policy_version": c.policy_version,
        "version_starts": c.version_starts,
        "reward": c.reward,
        "created_at": as_utc(c.created_at),
        "policy": policy,
    }


def episode_record(
    ep: Episode, completions: list[Completion], policy: str | None = None
) -> dict[str, Any]:
    return {
        "run_id": ep.run_id,
        "policy": policy,
        "episode_id": ep.id,
        "group_id": ep.group_id,
        "status": ep.status,
        "split": episode_split(ep),
        "reward": ep.reward,
        "train_step": ep.train_step,
        "created_at": as_utc(ep.created_at),
        "completions": [completion_record(c, policy) for c in completions],
    }


class ExportService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], page_size: int = 100) -> None:
        self.sessions = sessions
        self.page_size = page_size

    async def pages(self, run_id: str, filt: ExportFilter) -> AsyncIterator[list[dict[str, Any]]]:
        """Episode records of a run's split, oldest first, at most `page_size` at a time; a
        run with policies: each policy's in turn."""
        if not filt.can_match():
            return
        async with self.sessions() as s:
            policies = await policy_runs(s, run_id)
        for run, policy in [(p.id, p.policy) for p in policies] or [(run_id, None)]:
            async for page in self._pages(run, policy, filt):
                yield page

    async def _pages(
        self, run_id: str, policy: str | None, filt: ExportFilter
    ) -> AsyncIterator[list[dict[str, Any]]]:
        after: tuple[datetime, str] | None = None
        while True:
            async with self.sessions() as s:
                page = await episode_page(
                    s, run_id, filt.episodes(), limit=self.page_size, after=after
                )
                if not page:
                    return
                by_episode: dict[str, list[Completion]] = defaultdict(list)
                for c in await episode_completions(s, run_id, [e.id for e in page]):
                    by_episode[c.episode_id].append(c)
            yield [episode_record(e, by_episode[e.id], policy) for e in page]
            if len(page) < self.page_size:
                return
            after = (page[-1].created_at, page[-1].id)

    async def jsonl(self, run_id: str, filt: ExportFilter) -> AsyncIterator[bytes]:
        """One JSON object per line per episode; one chunk per page."""
        async for page in self.pages(run_id, filt):
            yield "".join(json.dumps(r, default=_json_default) + "\n" for r in page).encode()

    async def parquet_file(self, run_id: str, filt: ExportFilter) -> str:
        """Write the export to a temporary Parquet file (one row group per page); return its path.

        The caller deletes the file. Arrow work runs in a thread so the event
        loop keeps serving completions meanwhile.
        """
        fd, path = tempfile.mkstemp(prefix=f"rlgate-export-{run_id}-", suffix=".parquet")
        os.close(fd)
        try:
            writer = await asyncio.to_thread(pq.ParquetWriter, path, PARQUET_SCHEMA)
            try:
                async for page in self.pages(run_id, filt):
                    await asyncio.to_thread(_write_page, writer, page)
            finally:
                await asyncio.to_thread(writer.close)
        except BaseException:
            os.unlink(path)
            raise
        return path


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def _write_page(writer: pq.ParquetWriter, page: list[dict[str, Any]]) -> None:
    rows = [
        r | {"completions": [c | {"messages": json.dumps(c["messages"])} for c in r["completions"]]}
        for r in page
    ]
    writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=PARQUET_SCHEMA))
