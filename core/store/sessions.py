"""Dashboard sessions logged out before they expired, so that no process accepts them again.

A dashboard session is a signed cookie (`gateway.dashboard.auth`) that every
gateway process sharing the admin key accepts; logging out records its id
here, where every process sharing the store sees it at once. Rows are kept
only until the cookie would have expired anyway: each logout deletes the
expired ones. Importing this module registers the table on `Base.metadata`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import DateTime, String, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from core.store.models import Base, utcnow


class RevokedSession(Base):
    __tablename__ = "revoked_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


async def is_revoked(session: AsyncSession, sid: str) -> bool:
    stmt = select(RevokedSession.id).where(RevokedSession.id == sid)
    return (await session.execute(stmt)).first() is not None


async def revoke(session: AsyncSession, sid: str, expires: int) -> None:
    """Record `sid` (its cookie good until the unix time `expires`); drop the expired rows."""
    await session.execute(delete(RevokedSession).where(RevokedSession.expires_at < utcnow()))
    dialect = session.bind.dialect.name if session.bind is not None else "sqlite"
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = insert(RevokedSession).values(id=sid, expires_at=datetime.fromtimestamp(expires, UTC))
    await session.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))
