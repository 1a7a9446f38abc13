"""Each version records the AdamW state of the step attempt that wrote it.

A version's checkpoint path already names that attempt's own directory
(core/store/checkpoints.py); the optimizer state gets the same, so a losing
attempt's moments never replace the committed ones. Null: recorded before this
revision, read from the old fixed layout.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("optimizer_path", sa.String(1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("optimizer_path")
