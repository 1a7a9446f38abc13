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
  request at a time it adds no latency.
* A batch is all-or-nothing. If it fails on a row (an integrity error, a
  race with another gateway creating the same episode), the batch is rolled
  back and its requests are retried one transaction each, so one bad row
  fails only its own request. If the database is unreachable, every request
  of the batch gets a retryable 503 and nothing of the batch is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import make_transient

from gateway.errors import Unavailable
from gateway.store.completions import insert_completions
from gateway.store.episodes import episodes_by_key, insert_episodes
from gateway.store.models import Completion, utcnow
from gateway.store.rewards import has_episode_reward
from gateway.store.status import UNGROUPED, EpisodeStatus

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
class _Item:
    rows: list[Completion]
    group_id: str | None
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


async def write_rows(
    session: AsyncSession, items: list[tuple[list[Completion], str | None]]
) -> None:
    """Add the rows and the episodes they open, inside the caller's transaction.

    Episodes are read in one query for the whole batch (none for the fresh ids
    of new conversations); an episode that has an episode reward and gets a new
    turn is reopened (it was not over).
    """
    wanted: dict[tuple[str, str], str | None] = {}
    known: set[tuple[str, str]] = set()  # episodes that may exist already
    for rows, group_id in items:
        for row in rows:
            wanted.setdefault((row.run_id, row.episode_id), group_id)
            if row.link != "new":  # "new": a fresh id the placement just drew, unseen
                known.add((row.run_id, row.episode_id))
    episodes = await episodes_by_key(session, known)
    new_episodes = []
    for key, group_id in wanted.items():
        ep = episodes.get(key)
        if ep is None:
            new_episodes.append({"run_id": key[0], "id": key[1], "group_id": group_id or UNGROUPED})
        elif ep.status == EpisodeStatus.REWARDED and not await has_episode_reward(session, ep):
            # A new turn after per-turn rewards: the episode was not over.
            ep.status, ep.reward, ep.rewarded_at = EpisodeStatus.OPEN, None, None
    await session.flush()
    now = utcnow()
    for ep in new_episodes:
        ep.update(status=EpisodeStatus.OPEN, created_at=now)
    await insert_episodes(session, new_episodes)
    await insert_completions(session, [row for rows, _ in items for row in rows], now)


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
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.retries = retries
        self._pending: list[_Item] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.batches = 0  # commits made (a figure for the bench and the tests)
        self.rows = 0

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

    async def submit(self, rows: list[Completion], group_id: str | None) -> None:
        """Return once `rows` are committed; raise `Unavailable` if the database is down."""
        if self._task is None or self._closing:
            # Not started (a service used without the app lifespan) or shutting down.
            await self._write_one(_Item(rows, group_id))
            return
        item = _Item(rows, group_id)
        self._pending.append(item)
        self._wake.set()
        # Shielded: a client that goes away does not unsubmit its row; it is still written.
        await asyncio.shield(item.done)

    async def _run(self) -> None:
        while True:
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
        for item in batch:
            _settle(item, None)

    async def _commit(self, batch: list[_Item]) -> None:
        try:
            async with self.sessions.begin() as s:
                await write_rows(s, [(it.rows, it.group_id) for it in batch])
        except BaseException:
            for it in batch:
                for row in it.rows:
                    make_transient(row)
            raise
        self.batches += 1
        self.rows += sum(len(it.rows) for it in batch)

    async def _write_one(self, item: _Item) -> None:
        """One transaction for one request; a race creating its episode is retried."""
        for attempt in range(self.retries):
            try:
                await self._commit([item])
                return
            except IntegrityError:
                if attempt == self.retries - 1:
                    raise
            except Exception as exc:
                if is_outage(exc):
                    raise unavailable(exc) from exc
                raise


def _settle(item: _Item, error: BaseException | None) -> None:
    if item.done.done():
        return
    if error is None:
        item.done.set_result(None)
    else:
        item.done.set_exception(error)
