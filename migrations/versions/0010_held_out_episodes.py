"""Held-out (evaluation) episodes: a split that no completion can cross.

An episode called under `/eval` is held out for life (`episodes.held_out`),
and so is every completion stored in it (`completions.held_out`). The
completions' foreign key to their episode now includes the flag, so the store
itself refuses a training completion in an evaluation episode and the reverse:
a training call that names an evaluation episode's id is refused at its commit
without any read before it samples. Every row stored before this revision is
a training row (false).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SPLIT_INDEX = "uq_episodes_split"
SPLIT_FK = "fk_completions_episode_split"
# SQLite's foreign keys have no names: batch mode names the reflected ones by this rule.
NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def _episode_fk() -> str:
    """The name of the completions -> episodes foreign key that revision 0001 created."""
    for fk in sa.inspect(op.get_bind()).get_foreign_keys("completions"):
        if fk["referred_table"] == "episodes":
            # unnamed on SQLite (as 0001 made it): batch mode names it by NAMING
            return fk["name"] or "fk_completions_run_id_episodes"
    raise RuntimeError("completions has no foreign key to episodes")


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(
            sa.Column("held_out", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    # A unique index, not a constraint: SQLite adds it without rebuilding the table.
    op.create_index(SPLIT_INDEX, "episodes", ["run_id", "id", "held_out"], unique=True)
    old_fk = _episode_fk()
    with op.batch_alter_table("completions", naming_convention=NAMING) as batch:
        batch.add_column(
            sa.Column("held_out", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.drop_constraint(old_fk, type_="foreignkey")
        batch.create_foreign_key(
            SPLIT_FK,
            "episodes",
            ["run_id", "episode_id", "held_out"],
            ["run_id", "id", "held_out"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    with op.batch_alter_table("completions", naming_convention=NAMING) as batch:
        batch.drop_constraint(SPLIT_FK, type_="foreignkey")
        batch.create_foreign_key(  # its name on PostgreSQL before this revision
            "completions_run_id_episode_id_fkey",
            "episodes",
            ["run_id", "episode_id"],
            ["run_id", "id"],
            ondelete="CASCADE",
        )
        batch.drop_column("held_out")
    op.drop_index(SPLIT_INDEX, table_name="episodes")
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("held_out")
