"""The version each inference server holds, so several gateway processes label alike.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("run_replicas") as batch:
        batch.add_column(
            sa.Column("served_version", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("run_replicas") as batch:
        batch.drop_column("served_version")
