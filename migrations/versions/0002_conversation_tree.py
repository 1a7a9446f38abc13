"""Conversation trees: hashes for prefix matching, splice and drift flags on completions.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("conv_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("prompt_hash", sa.String(64), nullable=True))
        batch.add_column(
            sa.Column("spliced", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(
            sa.Column("drift", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("link", sa.String(10), nullable=True))
        batch.add_column(sa.Column("tool_calls", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("reasoning_content", sa.Text(), nullable=True))
    op.create_index("ix_completions_run_conv_hash", "completions", ["run_id", "conv_hash"])


def downgrade() -> None:
    op.drop_index("ix_completions_run_conv_hash", table_name="completions")
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("reasoning_content")
        batch.drop_column("tool_calls")
        batch.drop_column("link")
        batch.drop_column("drift")
        batch.drop_column("spliced")
        batch.drop_column("prompt_hash")
        batch.drop_column("conv_hash")
