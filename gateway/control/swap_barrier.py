"""A hot swap that every gateway process on one PostgreSQL store agrees on.

Several gateway processes (`rlgate up --workers N`, or several hosts) each
hold their own clients of a run's inference servers. If each reloaded the
servers at its own time, a process that has not swapped yet would keep
sending requests to a server that already runs N+1 and label them N. So one
process reloads, every process's gates are closed while it does, and the
requests in flight either finish first (`drain`) or are paused by the server
and go on with N+1, each token labelled with its version (`keep`).

The lock. Per run, a PostgreSQL advisory lock used as a reader/writer lock
(`SWAP_CLASS` and a hash of the schema and run id), each process on a
connection of its own per run it serves:

* a process serving the run holds it **shared** while its clients' gates are
  open (from `join`, when it loads the run, until `leave`);
* a swap takes it **exclusive**, which PostgreSQL grants once every process has
  released its shared hold; shared requests made meanwhile queue behind the
  waiting exclusive one, so a swap is never starved.

The swap (`swap(source, version, policy)`), in every process whose `SwapLoop`
sees a newer version:

1. close this process's gates (`ReplicaSet.quiesced`); with `drain`, also
   wait for its requests in flight to finish; with `keep` they go on;
2. release shared, wait for exclusive (every other process has done step 1);
3. read each server's version (`run_replicas.served_version`); a server behind
   is reloaded (only the first process through finds one), and what it now
   holds is written back before the lock goes. With `keep` the server pauses
   every process's requests in flight between two tokens for the reload, and
   they go on with the new weights;
4. release exclusive, take shared again, adopt the recorded versions as this
   process's labels, open the gates.

While it waits in step 2 the request gives way every `poll_s` to read the
record, and a process that finds the version recorded skips to step 4. A
process that joined during the swap holds shared at the new version and has
no reason to release it; a late process queued behind it would otherwise
wait for it forever.

So each server is reloaded once per version, and every token records the
version that sampled it. With `drain` a completion's version is the one its
server held from its first token to its last. With `keep` a completion that
lived through the reload says where the new version began
(`GenerateResult.version_starts`): the reloading process marks its own
requests while the server is paused, and the others' requests are labelled
by the server itself (its per-token weight-version labels, which win over a
client's marks), since their clients learn of the version only after the
server resumed. A server that labels no tokens (SGLang) is therefore drained
under a shared swap whatever the policy (`inference.replicas.shared_policy`).
New requests wait at the gates from the moment the first process notices the
version until the last one has (`RLGATE_SYNC_INTERVAL_S`), plus the reload
(and, with `drain`, the drain); requests already generating wait only for
the reload (`keep`).

Joining. The first process to serve a run (no one else holds the lock:
`pg_try_advisory_lock` succeeds) brings the servers to the run's version as a
single process would, records it and takes shared. A later one takes shared
(waiting out a swap under way) and adopts the recorded versions without
reloading anything.

Failure. A process that dies loses its connection, and its locks go with the
session: a swap waits for no dead process, and a swapper that died mid-reload
left the record behind, so the next process through reloads again. A version
that some server failed to load is tried again after `retry_s`, not on every
pass (each try closes every process's gates). A process whose lock
connection died (a database restart) finds out at its next pass (`check`)
and, with its requests drained, takes shared again and adopts the record.

Not covered: a LoRA run's adapter (`AdapterView`) still loads per process,
and a replica that returns or is added is brought to the set's weights by each
process as it admits it (docs/deployment.md).

The barrier is a `ServerSwaps` (`inference.swap`), chosen once at start-up:
`join` hands the pool a `BarrierSwap`, the run's `Swapper`, so the swap loop
has no branch for it. SQLite (one process): `SoleServerSwaps`, each process
swaps its own clients.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from core.store.db import is_postgres, normalize_url
from inference.swap import ServerSwaps, SharedReplicas, SoleServerSwaps, Swapper, WeightsSource
from inference.types import KEEP, SwapPolicy

logger = logging.getLogger(__name__)

SWAP_CLASS = 0x726C6777  # "rlgw"; the second key hashes the schema and the run id
KEY = "hashtext(current_schema() || '/' || :run)"
LOCK_NOT_AVAILABLE = "55P03"  # lock_timeout ran out


class RunLock:
    """One run's reader/writer advisory lock, on a connection opened for nothing else."""

    def __init__(self, conn: AsyncConnection, run_id: str) -> None:
        self.conn, self.run_id = conn, run_id

    async def _call(self, fn: str) -> Any:
        sql = f"SELECT {fn}(:cls, {KEY})"
        return await self.conn.scalar(text(sql), {"cls": SWAP_CLASS, "run": self.run_id})

    async def try_exclusive(self) -> bool:
        return bool(await self._call("pg_try_advisory_lock"))

    async def exclusive(self) -> None:
        await self._call("pg_advisory_lock")

    async def release_exclusive(self) -> None:
        await self._call("pg_advisory_unlock")

    async def exclusive_unless(self, done: Callable[[dict[str, int]], bool], poll_s: float) -> bool:
        """Exclusive (True), or nothing held (False) once the record is `done` while we wait.

        The request stays queued (so shared requests made meanwhile wait behind it) but
        gives up every `poll_s` to read the record: a process that took shared at the new
        version (one that joined during the swap) would otherwise never release it.
        """
        await self.conn.execute(text(f"SET lock_timeout = {max(1, int(poll_s * 1000))}"))
        try:
            while True:
                try:
                    await self.exclusive()
                    return True
                except DBAPIError as exc:
                    if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                        raise
                if done(await self.recorded()):
                    return False
        finally:
            await self.conn.execute(text("SET lock_timeout = 0"))

    async def shared(self) -> None:
        await self._call("pg_advisory_lock_shared")

    async def release_shared(self) -> None:
        await self._call("pg_advisory_unlock_shared")

    async def recorded(self) -> dict[str, int]:
        """Each server's version as last written, by URL."""
        rows = await self.conn.execute(
            text("SELECT url, served_version FROM run_replicas WHERE run_id = :run"),
            {"run": self.run_id},
        )
        return {url: int(v) for url, v in rows}

    async def record(self, versions: dict[str, int]) -> None:
        for url, version in versions.items():
            await self.conn.execute(
                text(
                    "UPDATE run_replicas SET served_version = :v WHERE run_id = :run AND url = :url"
                ),
                {"v": version, "run": self.run_id, "url": url},
            )


class SwapBarrier:
    """The swap agreed by every gateway process on a PostgreSQL store (module docstring)."""

    def __init__(self, url: str, retry_s: float = 30.0, poll_s: float = 0.25) -> None:
        # Never pooled: a lock lives exactly as long as its connection.
        self._engine: AsyncEngine = create_async_engine(
            normalize_url(url, asynchronous=True),
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={"connect_timeout": 10},
        )
        self.retry_s = retry_s
        self.poll_s = poll_s  # a waiting swap reads the record this often
        self._locks: dict[str, RunLock] = {}
        self._tried: dict[str, tuple[int, float]] = {}  # run -> (version, when) of a failed swap

    async def join(
        self, run_id: str, replicas: SharedReplicas, source: WeightsSource | None, version: int
    ) -> Swapper:
        """This process starts serving the run through `replicas` (its clients, at version 0);
        the run's swapper from now on.

        `source`: the weights of `version`, loaded only if no other process serves the run.
        """
        await self.leave(run_id)
        async with self._holding(run_id) as lock:
            if await lock.try_exclusive():  # no other process serves it: the servers are ours
                try:
                    if version > 0 and source is not None:
                        await replicas.load_weights(source, version)
                finally:
                    await lock.record(replicas.versions())
                    await lock.release_exclusive()
            await lock.shared()  # after any swap under way, even one since the lines above
            target = (source, version) if source is not None else None
            replicas.set_versions(await lock.recorded(), target)
        return BarrierSwap(self, run_id, replicas)

    @contextlib.asynccontextmanager
    async def _holding(self, run_id: str) -> AsyncIterator[RunLock]:
        """A lock of the run on a connection of its own, kept as the run's once the block
        succeeds; a block that raises closes the connection, and the lock goes with it."""
        conn = await self._engine.connect()
        lock = RunLock(conn, run_id)
        try:
            yield lock
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close()
            raise
        self._locks[run_id] = lock

    async def swap(
        self,
        run_id: str,
        replicas: SharedReplicas,
        source: WeightsSource,
        version: int,
        policy: SwapPolicy = KEEP,
    ) -> None:
        """Bring this process's clients to `version`, reloading the servers if no one has;
        `policy` says what the requests in flight do (module docstring)."""
        lock = self._locks.get(run_id)
        if lock is None:
            raise RuntimeError(f"run {run_id}: its swap lock is not held (check first)")
        tried = self._tried.get(run_id)
        if tried and tried[0] == version and time.monotonic() - tried[1] < self.retry_s:
            return
        try:
            await self._swap(run_id, lock, replicas, source, version, policy)
        finally:
            if replicas.version < version:
                self._tried[run_id] = (version, time.monotonic())
            else:
                self._tried.pop(run_id, None)

    async def _swap(
        self,
        run_id: str,
        lock: RunLock,
        replicas: SharedReplicas,
        source: WeightsSource,
        version: int,
        policy: SwapPolicy,
    ) -> None:
        def done(recorded: dict[str, int]) -> bool:
            return _caught_up(recorded, replicas, version)

        async def exclusive() -> None:
            """Holding the lock alone: reload the servers still behind, record where they are."""
            recorded = await lock.recorded()
            replicas.set_versions(recorded, (source, version))
            if _caught_up(recorded, replicas, version):
                logger.info("run %s: v%d adopted (another process loaded it)", run_id, version)
                return
            try:
                await replicas.reload_quiesced(source, version, policy)
            finally:
                await lock.record(replicas.versions())

        what = f"swap to v{version} with the other gateway processes"
        async with replicas.quiesced(what, policy):
            failed: BaseException | None = None
            try:
                await lock.release_shared()
                if await lock.exclusive_unless(done, self.poll_s):
                    try:
                        await exclusive()
                    except Exception as exc:  # a server failed to load: serve on, then raise
                        failed = exc
                    await lock.release_exclusive()
                else:
                    logger.info("run %s: v%d adopted (recorded while waiting)", run_id, version)
                await lock.shared()
                replicas.set_versions(await lock.recorded(), (source, version))
            except BaseException:
                await self.leave(run_id)  # the lock is in no known state: give it up
                raise
            if failed is not None:
                raise failed

    async def check(self, run_id: str, replicas: SharedReplicas, policy: SwapPolicy = KEEP) -> None:
        """Hold the run's lock again if its connection died (a database restart took the lock
        with the session): with this process's gates closed (and, with `drain`, its requests
        drained), take shared and adopt the recorded versions. Raises while the database is
        away; the run keeps serving meanwhile.
        """
        lock = self._locks.get(run_id)
        if lock is not None:
            try:
                await lock.conn.execute(text("SELECT 1"))
                return
            except Exception as exc:
                logger.warning("run %s: its swap lock went with its connection: %s", run_id, exc)
                await self.leave(run_id)
        async with (
            self._holding(run_id) as lock,
            replicas.quiesced("hold the swap lock again", policy),
        ):
            await lock.shared()
            replicas.set_versions(await lock.recorded(), None)
        logger.info("run %s: swap lock held again", run_id)

    async def leave(self, run_id: str) -> None:
        """Stop serving the run: its lock goes with its connection."""
        lock = self._locks.pop(run_id, None)
        if lock is not None:
            with contextlib.suppress(Exception):
                await lock.conn.close()

    async def close(self) -> None:
        for run_id in list(self._locks):
            await self.leave(run_id)
        await self._engine.dispose()


class BarrierSwap:
    """One run's `Swapper` through the barrier: its replica set, swapped with the others.

    `policy`: the run's swap policy as of its last swap (keep until one), which `check`
    also applies when it takes the lock again.
    """

    def __init__(self, barrier: SwapBarrier, run_id: str, replicas: SharedReplicas) -> None:
        self.barrier, self.run_id, self.replicas = barrier, run_id, replicas
        self.policy = KEEP

    @property
    def version(self) -> int:
        return self.replicas.version

    async def check(self) -> None:
        # its lock held, or taken again
        await self.barrier.check(self.run_id, self.replicas, self.policy)

    async def swap(self, source: WeightsSource, version: int, policy: SwapPolicy = KEEP) -> None:
        """As `SwapBarrier.swap`: a server that did not load `version` leaves `version`
        behind, and the swap is tried again after the barrier's `retry_s`."""
        self.policy = policy
        await self.barrier.swap(self.run_id, self.replicas, source, version, policy)

    async def close(self) -> None:
        await self.barrier.leave(self.run_id)


def _caught_up(recorded: dict[str, int], replicas: SharedReplicas, version: int) -> bool:
    """Every server of `replicas` is recorded at `version` or later."""
    return all(recorded.get(name, 0) >= version for name in replicas.versions())


def make_server_swaps(url: str, retry_s: float = 30.0) -> ServerSwaps:
    """The barrier on PostgreSQL (other processes may serve the same runs); on SQLite this
    process swaps alone."""
    if is_postgres(url):
        return SwapBarrier(url, retry_s)
    return SoleServerSwaps()
