"""Completions record where each policy version began (keep-mode hot swaps).

A generation in flight when the weights change goes on with the new version,
so one completion can hold tokens of several versions. `version_starts` lists
[token index, version] pairs from [0, policy_version] on; null means every
token was sampled by `policy_version`, which is what every row stored before
this revision was.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.add_column(sa.Column("version_starts", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("completions") as batch:
        batch.drop_column("version_starts")
