"""SQLAlchemy 2 models of rlgate's tables; the Alembic migrations in `migrations/` create them.

The Responses API's own table is declared in `core.store.responses`, on the same `Base`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from core.store.status import EpisodeStatus, StepStatus
from core.store.types import FloatArray, IntArray


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """SQLite returns naive datetimes; every time stored here is UTC."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    # Every model here is mapped to one Table (declarative types it as any FromClause), and
    # the capture and scan paths hand it to Core's insert/update as one.
    __table__: ClassVar[Table]

    type_annotation_map = {dict[str, Any]: JSON}


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(500))  # alias or path as given
    model_path: Mapped[str] = mapped_column(String(1000))  # resolved HF directory
    backend: Mapped[str] = mapped_column(String(20), default="local")
    status: Mapped[str] = mapped_column(String(20), default="active")  # paused, stopped, failed
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    current_version: Mapped[int] = mapped_column(Integer, default=0)
    counters: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # A policy of a run (`RunConfig.policies`) is a run of its own: its LoRA adapter,
    # versions, steps and episodes' turns. `parent_id` is the run whose keys and episode
    # ids it shares, `policy` its name there; both null for every other run (migration 0011).
    parent_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    policy: Mapped[str | None] = mapped_column(String(64), nullable=True)


class RunReplica(Base):
    """One inference server (base URL) that serves a run; a run has one or more."""

    __tablename__ = "run_replicas"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    url: Mapped[str] = mapped_column(String(500), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The version the server holds, written by the gateway process that had it load that
    # version, before the other processes adopt it (gateway/control/swap_barrier.py).
    served_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(20), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class PolicyVersion(Base):
    __tablename__ = "policy_versions"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_path: Mapped[str] = mapped_column(String(1000))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The AdamW state the attempt that wrote this version saved (core.store.checkpoints);
    # null: none recorded, the layout before attempt directories applies.
    optimizer_path: Mapped[str | None] = mapped_column(String(1000), nullable=True)


class Episode(Base):
    """One attempt at a task. Ids come from the caller (path, header, metadata) or are drawn
    by the gateway (`ep-<hex>`), so they are unique per run only."""

    __tablename__ = "episodes"
    __table_args__ = (
        Index("ix_episodes_run_status", "run_id", "status"),
        # The key the completions' foreign key refers to: a completion's split is its episode's.
        Index("uq_episodes_split", "run_id", "id", "held_out", unique=True),
    )

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    group_id: Mapped[str] = mapped_column(String(100))
    # open -> rewarded -> queued -> trained, or expired / dropped (see EpisodeStatus)
    status: Mapped[str] = mapped_column(String(20), default=EpisodeStatus.OPEN)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The batch policy's last final verdict on its group (gateway.control.batch_policy.Verdict):
    # why it was dropped (stale, skipped_zero_variance, dropped_incomplete) or "chosen".
    verdict: Mapped[str | None] = mapped_column(String(30), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    rewarded_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Held out (an `/eval` call opened it): served and scored, never trained; status "eval".
    # Set when the episode is created and never changed.
    held_out: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Completion(Base):
    __tablename__ = "completions"
    __table_args__ = (
        # A completion is in its episode's split: the store refuses a training completion in
        # a held-out episode and the reverse (migration 0010).
        ForeignKeyConstraint(
            ["run_id", "episode_id", "held_out"],
            ["episodes.run_id", "episodes.id", "episodes.held_out"],
            ondelete="CASCADE",
            name="fk_completions_episode_split",
        ),
        Index("ix_completions_run_episode", "run_id", "episode_id"),
        Index("ix_completions_run_conv_hash", "run_id", "conv_hash"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    episode_id: Mapped[str] = mapped_column(String(100))
    parent_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    messages: Mapped[list[Any]] = mapped_column(JSON)
    prompt_token_ids: Mapped[list[int]] = mapped_column(IntArray)
    output_token_ids: Mapped[list[int]] = mapped_column(IntArray)
    output_logprobs: Mapped[list[float]] = mapped_column(FloatArray)
    content: Mapped[str] = mapped_column(Text)
    finish_reason: Mapped[str] = mapped_column(String(20))
    temperature: Mapped[float] = mapped_column(Float)
    # The oldest version among its tokens (the first token's): the one staleness counts.
    policy_version: Mapped[int] = mapped_column(Integer)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Where each version began when a keep-mode swap happened while it sampled:
    # [[token index, version], ...] from [0, policy_version] on (`GenerateResult.version_starts`);
    # null (SQL NULL): every token was sampled by `policy_version`.
    version_starts: Mapped[list[list[int]] | None] = mapped_column(
        JSON(none_as_null=True), nullable=True
    )
    # Hash of messages + this answer: a later call whose history starts with it continues here.
    conv_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    prompt_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The prompt is the parent's prompt ids + the parent's sampled ids + newly rendered ids.
    spliced: Mapped[bool] = mapped_column(Boolean, default=False)
    # The parent's history re-rendered differently from what was sampled: a new training sequence.
    drift: Mapped[bool] = mapped_column(Boolean, default=False)
    # How the call found its episode: path, header, metadata, prefix (matched) or new.
    link: Mapped[str | None] = mapped_column(String(10), nullable=True)
    # Tool calls parsed from the sampled text (OpenAI's shape); the text stays in the ids.
    tool_calls: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    reasoning_content: Mapped[str | None] = mapped_column(Text, nullable=True)
    held_out: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(token index, version) where each version began; one pair when one version."""
        if self.version_starts:
            return [(int(i), int(v)) for i, v in self.version_starts]
        return [(0, self.policy_version)]

    def token_versions(self) -> list[int]:
        """The version that sampled each output token, in order."""
        out: list[int] = []
        spans = self.spans
        for k, (start, version) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(self.output_token_ids)
            out.extend([version] * (end - start))
        return out


def stored_version_starts(starts: tuple[tuple[int, int], ...]) -> list[list[int]] | None:
    """A result's `version_starts` as the column stores it (None when one version)."""
    return [[int(i), int(v)] for i, v in starts] or None


class Reward(Base):
    """Every stored reward post, as received (the audit trail). A retry with an idempotency
    key already seen is acknowledged as a duplicate and not stored again."""

    __tablename__ = "rewards"
    __table_args__ = (UniqueConstraint("run_id", "idempotency_key", name="uq_rewards_idem"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    completion_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    episode_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    value: Mapped[float] = mapped_column(Float)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # A policy-scoped episode reward names its policy; null: every policy's turns.
    policy: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TrainStep(Base):
    __tablename__ = "train_steps"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)  # trains version step -> step+1
    # queued -> running -> done | failed (see StepStatus)
    status: Mapped[str] = mapped_column(String(20), default=StepStatus.QUEUED)
    n_episodes: Mapped[int] = mapped_column(Integer, default=0)
    n_groups: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    reward_mean: Mapped[float | None] = mapped_column(Float, nullable=True)
    reward_std: Mapped[float | None] = mapped_column(Float, nullable=True)
    tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
