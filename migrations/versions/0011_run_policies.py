"""Policies of a run: a policy is a run of its own under its parent (docs/policies.md).

`runs.parent_id` names the run whose agent keys and episodes it shares, `runs.policy`
its name there; both are null for every other run. `rewards.policy` names the policy a
policy-scoped episode reward was for. No foreign key: on SQLite adding
one rebuilds `runs`, and dropping the old table would cascade into every table that
refers to it. `core.store.runs.delete_run` deletes a run's policies with it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("parent_id", sa.String(40), nullable=True))
    op.add_column("runs", sa.Column("policy", sa.String(64), nullable=True))
    op.create_index("ix_runs_parent_id", "runs", ["parent_id"])
    op.add_column("rewards", sa.Column("policy", sa.String(64), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+, PostgreSQL): a batch rebuild of `runs` would drop
    # the old table, and on SQLite that cascades into every table that refers to it.
    op.drop_index("ix_runs_parent_id", table_name="runs")
    for table, column in (("rewards", "policy"), ("runs", "policy"), ("runs", "parent_id")):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
