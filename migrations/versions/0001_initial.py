"""Initial schema: runs, keys, versions, episodes, completions, rewards, train steps.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("model", sa.String(500), nullable=False),
        sa.Column("model_path", sa.String(1000), nullable=False),
        sa.Column("backend", sa.String(20), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("current_version", sa.Integer(), nullable=False),
        sa.Column("counters", sa.JSON(), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("prefix", sa.String(20), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("revoked_at", TZ, nullable=True),
    )
    op.create_index("ix_api_keys_run_id", "api_keys", ["run_id"])
    op.create_index("ix_api_keys_prefix", "api_keys", ["prefix"])
    op.create_table(
        "policy_versions",
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("checkpoint_path", sa.String(1000), nullable=False),
        sa.Column("created_at", TZ, nullable=False),
    )
    op.create_table(
        "episodes",
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("group_id", sa.String(100), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("train_step", sa.Integer(), nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("rewarded_at", TZ, nullable=True),
    )
    op.create_index("ix_episodes_run_status", "episodes", ["run_id", "status"])
    op.create_table(
        "completions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("episode_id", sa.String(100), nullable=False),
        sa.Column("parent_id", sa.String(64), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("prompt_token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.String(20), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id", "episode_id"], ["episodes.run_id", "episodes.id"], ondelete="CASCADE"
        ),
    )
    op.create_index("ix_completions_run_episode", "completions", ["run_id", "episode_id"])
    op.create_table(
        "rewards",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("completion_id", sa.String(64), nullable=True),
        sa.Column("episode_id", sa.String(100), nullable=True),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.UniqueConstraint("run_id", "idempotency_key", name="uq_rewards_idem"),
    )
    op.create_index("ix_rewards_run_id", "rewards", ["run_id"])
    op.create_table(
        "train_steps",
        sa.Column(
            "run_id", sa.String(40), sa.ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("step", sa.Integer(), primary_key=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("n_episodes", sa.Integer(), nullable=False),
        sa.Column("n_groups", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("reward_std", sa.Float(), nullable=True),
        sa.Column("tokens", sa.Integer(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("enqueued_at", TZ, nullable=True),
        sa.Column("finished_at", TZ, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("train_steps")
    op.drop_index("ix_rewards_run_id", table_name="rewards")
    op.drop_table("rewards")
    op.drop_index("ix_completions_run_episode", table_name="completions")
    op.drop_table("completions")
    op.drop_index("ix_episodes_run_status", table_name="episodes")
    op.drop_table("episodes")
    op.drop_table("policy_versions")
    op.drop_index("ix_api_keys_prefix", table_name="api_keys")
    op.drop_index("ix_api_keys_run_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("runs")
