"""Group commit of captured completions: many requests' rows, one transaction, no lost rows.

Ordering contract:

* A request hands its rows to `CaptureWriter.submit` and awaits ITS batch's
  commit; the response (or a stream's final chunk and `[DONE]`) is sent only
  after that. So every completion a client received is in the database, even
  if the gateway is killed with -9 right after, and a follow-up turn (which
  the agent can send only after it got the answer) always finds its parent.
* One writer task commits batches one after the other. Rows that arrive
  while a commit is in flight wait and go out together in the next one (at
  most `max_batch` rows; `linger_s` optionally waits a little longer for
  more). Under load this turns N commits into N / batch commits; with one
  request at a time it adds no latency. (One writer, not two: a second
  commit in flight beside the first makes a row's commit slower, not faster.)
* A batch is all-or-nothing. If it fails on a row (an integrity error), the
  batch is rolled back and its requests are retried one transaction each, so
  one bad row fails only its own request. An episode that another gateway
  process created meanwhile is no failure (ON CONFLICT DO NOTHING).
  If the database is unreachable, every request of the batch gets a
  retryable 503 and nothing of the batch is written.
* On PostgreSQL a batch is one round trip (`core.store.capture_pg`).

Token usage: every stored completion's prompt and output token counts are
added to the request's `StoredTokens` (if its caller set one, as
`QuotaMiddleware` does): what a key is metered for is what was stored for
it, on every endpoint, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import make_transient

from core.store.capture_pg import write_batch
from core.store.completions import insert_completions
from core.store.episodes import insert_episodes, reopen_rewarded
from core.store.models import Completion, Episode, utcnow
from core.store.pg_driver import driver_connection, psycopg_engine
from core.store.status import UNGROUPED, EpisodeStatus
from gateway.errors import Conflict, Unavailable

logger = logging.getLogger(__name__)


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` means the database is unreachable (retry later), not a bad row."""
    if isinstance(exc, OperationalError | InterfaceError | ConnectionError | TimeoutError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def unavailable(exc: BaseException) -> Unavailable:
    return Unavailable(
        "the database is unavailable; the completion was not stored, retry the request",
        code="database_unavailable",
    )


@dataclass
class StoredTokens:
    """The tokens stored for one request: each completion's prompt plus its output (an
    `n = 2` call stores, and counts, its prompt twice)."""

    tokens: int = 0

    def add(self, rows: list[Completion]) -> None:
        self.tokens += sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows)


# Set per request by whoever meters it; a context variable, so a stream's tasks share it.
stored_tokens: contextvars.ContextVar[StoredTokens | None] = contextvars.ContextVar(
    "stored_tokens", default=None
)


@dataclass
class _Item:
    rows: list[Completion]
    group_id: str | None
    status: EpisodeStatus  # of the episodes its rows open: OPEN, or EVAL for held-out calls
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


Batch = list[tuple[list[Completion], str | None, EpisodeStatus]]  # rows, group, episode status


def plan(
    items: Batch,
) -> tuple[list[dict[str, Any]], set[tuple[str, str]], list[Completion], datetime]:
    """A batch's writes: the episodes its rows open (to insert unless stored), those that may
    exist already (to reopen if rewarded turn by turn), its completions, and its time.

    An episode opens as its first request says: open (training) or eval (held out); the
    reopen statement only touches rewarded episodes, so it never moves an eval one."""
    wanted: dict[tuple[str, str], tuple[str | None, EpisodeStatus]] = {}
    known: set[tuple[str, str]] = set()  # episodes that may exist already
    for rows, group_id, status in items:
        for row in rows:
            wanted.setdefault((row.run_id, row.episode_id), (group_id, status))
            if row.link != "new":  # "new": a fresh id the placement just drew, unseen
                known.add((row.run_id, row.episode_id))
    now = utcnow()
    episodes = [
        {"run_id": run_id, "id": ep_id, "group_id": group_id or UNGROUPED,
         "status": status, "created_at": now, "held_out": status == EpisodeStatus.EVAL}
        for (run_id, ep_id), (group_id, status) in wanted.items()
    ]  # fmt: skip
    return episodes, known, [row for rows, _, _ in items for row in rows], now


async def write_rows(session: AsyncSession, items: Batch) -> None:
    """Add the rows and the episodes they open, inside the caller's transaction.

    Nothing is read first: the episodes not stored yet (none of a fresh id can
    be), then every episode that may exist and was rewarded turn by turn opened
    again (a new turn means it was not over), then the completions. On
    PostgreSQL the writer sends the same three statements in one pipeline
    instead (`core.store.capture_pg`).
    """
    episodes, known, rows, now = plan(items)
    await insert_episodes(session, episodes)
    await reopen_rewarded(session, known)
    await insert_completions(session, rows, now)


class CaptureWriter:
    """Collects completion rows from concurrent requests and commits them in batches."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        max_batch: int = 128,
        linger_s: float = 0.0,
        retries: int = 3,
    ) -> None:
        self.sessions = sessions
        # PostgreSQL: a batch is one round trip on a pooled connection's psycopg connection
        self._pg = psycopg_engine(sessions)
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.retries = retries
        self._pending: list[_Item] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.batches = 0  # commits made (a figure for the bench and the tests)
        self.rows = 0
        self._outage = False  # the last batch found the database unreachable
        # called with the rows of each commit (the /metrics counters), never before it
        self.on_commit: Callable[[list[Completion]], None] | None = None

    async def check(self) -> None:
        """Raise the outage's 503 if the last batch found the database unreachable and it
        still is (one round trip, only after such a batch).

        Called before a call samples: without it a call that reads nothing first (a new
        conversation, its admission count still fresh) would sample, or open a stream,
        and only fail at its commit.
        """
        if not self._outage:
            return
        try:
            async with self.sessions() as s:
                await s.execute(text("SELECT 1"))
        except Exception as exc:
            if is_outage(exc):
                raise unavailable(exc) from exc
            raise
        self._outage = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="capture-writer")

    async def close(self) -> None:
        """Write what is waiting, then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def submit(
        self, rows: list[Completion], group_id: str | None, *, evaluation: bool = False
    ) -> None:
        """Return once `rows` are committed; raise `Unavailable` if the database is down.

        `evaluation`: the episodes the rows open are held out (`EpisodeStatus.EVAL`)."""
        status = EpisodeStatus.EVAL if evaluation else EpisodeStatus.OPEN
        if self._task is None or self._closing:
            # Not started (a service used without the app lifespan) or shutting down.
            await self._write_one(_Item(rows, group_id, status))
            _count(rows)
            return
        item = _Item(rows, group_id, status)
        self._pending.append(item)
        self._wake.set()
        # Shielded: a client that goes away does not unsubmit its row; it is still written.
        await asyncio.shield(item.done)
        _count(rows)

    async def _run(self) -> None:
        while True:
            if not self._closing:  # closing: drain what is left, then stop
                await self._wake.wait()
            if self.linger_s > 0 and len(self._pending) < self.max_batch and not self._closing:
                await asyncio.sleep(self.linger_s)
            batch = self._pending[: self.max_batch]
            del self._pending[: len(batch)]
            if not self._pending:
                self._wake.clear()
            if batch:
                await self._write_batch(batch)
            elif self._closing:
                return

    async def _write_batch(self, batch: list[_Item]) -> None:
        try:
            await self._commit(batch)
        except Exception as exc:
            if is_outage(exc):
                self._outage = True
                logger.warning(
                    "database unavailable: %d completions not stored: %s", len(batch), exc
                )
                for item in batch:
                    _settle(item, unavailable(exc))
                return
            if len(batch) == 1 and not isinstance(exc, IntegrityError):
                _settle(batch[0], exc)
                return
            logger.info("batch of %d failed (%s): writing row by row", len(batch), exc)
            for item in batch:
                try:
                    await self._write_one(item)
                except Exception as one:
                    _settle(item, one)
                else:
                    _settle(item, None)
            return
        self._outage = False
        for item in batch:
            _settle(item, None)

    async def _commit(self, batch: list[_Item]) -> None:
        try:
            items: Batch = [(it.rows, it.group_id, it.status) for it in batch]
            if self._pg is not None:
                async with driver_connection(self._pg) as conn:
                    await write_batch(conn, *plan(items))
            else:
                async with self.sessions() as s:
                    await write_rows(s, items)
                    await s.commit()
        except BaseException:
            for it in batch:
                for row in it.rows:
                    make_transient(row)
            raise
        self.batches += 1
        self.rows += sum(len(it.rows) for it in batch)
        if self.on_commit is not None:
            self.on_commit([row for it in batch for row in it.rows])

    async def _write_one(self, item: _Item) -> None:
        """One transaction for one request; a race creating its episode is retried, a row
        its episode's split refuses is a 409 (`split_conflict`)."""
        for attempt in range(self.retries):
            try:
                await self._commit([item])
                return
            except IntegrityError:
                conflict = await self.split_conflict(item)
                if conflict is not None:
                    raise conflict from None
                if attempt == self.retries - 1:
                    raise
            except Exception as exc:
                if is_outage(exc):
                    self._outage = True
                    raise unavailable(exc) from exc
                raise

    async def split_conflict(self, item: _Item) -> Conflict | None:
        """The 409 for a request whose rows name an episode of the other split (a training
        call naming a held-out episode's id, or the reverse), which the store refused
        (`completions.held_out` is part of their key to `episodes`); None otherwise.

        Read only after a refused write: an evaluation call is checked before it samples
        (`ChatService.place`), a training call is not, so that no new named training
        conversation pays a read for it."""
        held_out = item.status == EpisodeStatus.EVAL
        keys = {(row.run_id, row.episode_id) for row in item.rows}
        async with self.sessions() as s:
            for run_id, episode_id in keys:
                stored = await s.get(Episode, (run_id, episode_id))
                if stored is not None and stored.held_out != held_out:
                    return split_conflict(episode_id, evaluation=held_out)
        return None


def split_conflict(episode_id: str, *, evaluation: bool) -> Conflict:
    """The 409 of a call that names an episode of the other split."""
    split, other = ("evaluation", "training")[:: 1 if evaluation else -1]
    return Conflict(
        f"episode {episode_id!r} is a {other} episode; a {split} call cannot join it "
        "(evaluation calls go under /eval, training calls not)",
        param="episode_id",
        code="episode_split_conflict",
    )


def _count(rows: list[Completion]) -> None:
    """Stored: the rows' tokens count for the request that stored them."""
    usage = stored_tokens.get()
    if usage is not None:
        usage.add(rows)


def _settle(item: _Item, error: BaseException | None) -> None:
    if item.done.done():
        return
    if error is None:
        item.done.set_result(None)
    else:
        item.done.set_exception(error)
