"""Stored Responses-API objects, so that `previous_response_id` can continue a conversation.

Kept out of `core.store.models` on purpose: only the Responses endpoint
reads or writes this table. Importing this module registers the table on
`Base.metadata`. The tokens themselves are never here: each response points
at the `Completion` row that holds its exact prompt and sampled ids.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from core.store.models import Base, utcnow


class StoredResponse(Base):
    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_<hex>
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    # The completion that sampled this response's output (a plain id, like rewards').
    completion_id: Mapped[str] = mapped_column(String(64))
    previous_response_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The whole conversation as Responses items: the history it continued, its own
    # input items, then its output items. A follow-up prepends exactly this list.
    items: Mapped[list[Any]] = mapped_column(JSON)
    # The response object as it was answered (GET /v1/responses/{id} returns it).
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
