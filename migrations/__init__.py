"""Alembic environment and versions for the rlgate store."""
