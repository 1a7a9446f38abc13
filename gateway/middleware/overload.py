"""Overload control: bounded sampling calls per process, run and backend; a quick 429 beyond.

Past saturation a gateway that takes every call does less work, not the
same work more slowly: every admitted call competes for the one event loop,
the database pool and the capture writer, so each one's latency grows with
the number in flight and clients time out on work already half done. Here a
sampling call (POST `/v1/chat/completions`, `/v1/completions`,
`/v1/responses`, `/v1/messages`, under any episode prefix) takes a slot
once its key is valid (`gateway.middleware.identity.AgentKeyCheck` runs first and
answers a missing or wrong key 401 at once, so no stranger holds a slot)
and before any other work starts (the body is read after), and gives it
back once its response (stream included) is sent:

* **slots.** Up to `limit` calls run at once per scope: this process,
  the caller's run, and the run's backend (its own, or the base model that
  LoRA runs share in-process). A call takes its run's slot, then its
  backend's, then the process's.
* **queue.** A call that finds no free slot waits in a FIFO of at most
  `max_queue` callers per scope; a freed slot goes to the oldest waiter
  (handed over, never raced for). A call that finds the queue full is
  answered at once.
* **fair share.** While calls of other runs wait, one run holds at most
  `run_share` (default 0.5) of the process's slots (and of a backend scope
  that runs share): a freed slot goes to the oldest waiter of a run under
  its share, and only when no such waiter exists to the oldest waiter. A
  run alone may use every slot; a flooding run cannot starve the others,
  which get the next slots freed. Nothing is preempted: a call already
  holding a slot keeps it. The queue is shared the same way: a run alone
  may fill it, and when it is full a call of a run with fewer than
  `run_share` of its places turns away (429, `queue_full`) the newest waiter
  of the run with the most places past its share, and takes its place.
* **deadline.** A waiter not given a slot within `queue_timeout_s` is
  answered then. Either answer is 429 `rate_limit_error`, code
  `overloaded`, with `retry-after-ms` and `Retry-After` (the `openai` SDK
  prefers the former and honours values up to 60 s; its default two retries
  then wait that long). The wait is estimated from the queue ahead and the
  recent time a call holds a slot, with up to 50 % jitter so that callers
  turned away together do not return together.

The process limit adapts (`AdaptiveLimit`), between `min_inflight` and
`max_inflight`: a gateway whose calls mostly wait on a GPU server needs
hundreds in flight, while one whose own CPU is the bottleneck (a fast
backend, many small calls) serves more with a few dozen. The signal is the
event loop's lag: while it stays under `lag_target_s` and the limit is in
use, the limit grows by 5 % per tick; above it, it shrinks by 20 %. A call
already admitted always finishes; only new ones wait. The target (10 ms)
weighs CPU per call against idle CPU: a CPU-bound process allowed more lag
holds so many calls in flight that each costs it more CPU, and one allowed
less holds too few to keep its core busy. A process whose calls wait on a
GPU server keeps its loop nearly idle, so its limit still grows to the
maximum.

A call whose client disconnects while it waits is dropped when its turn
comes, before any of its work (its body is read first to tell), and counted
as status 499, nginx's "client closed request".

The run of a call is the one `AgentKeyCheck` authenticated (through
`RunKeyCache`), so the scopes cost no database read here.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.config import OverloadConfig
from core.store.models import Run
from gateway.errors import RateLimited, error_response
from gateway.middleware.identity import is_sampling_call
from inference import registry

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0  # what the openai SDK honours (newer versions: 120)
MIN_RETRY_AFTER_S = 0.1
CLIENT_CLOSED = 499  # nginx's status for a request whose client left first


class Overloaded(Exception):
    """No slot: the queue was full, or the deadline passed first."""

    def __init__(self, scope: str, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{scope}: {reason}")
        self.scope, self.reason, self.retry_after_s = scope, reason, retry_after_s


class Limiter:
    """`limit` slots and a queue of at most `max_queue` waiters (0: unbounded).

    Waiters queue per owner (a run; None for a call without one). A freed slot goes
    to the oldest waiter whose owner holds fewer than `share` of the slots, else to the
    oldest waiter; a full queue turns away the newest waiter of an owner past its share
    of the places to seat one under it (see "fair share" in the module docstring).
    """

    def __init__(self, name: str, limit: int, max_queue: int, share: float = 1.0) -> None:
        self.name = name
        self.limit = limit
        self.max_queue = max_queue
        self.share = share
        self.inflight = 0
        self.inflight_peak = 0
        self.queue_peak = 0
        self.rejected = {"queue_full": 0, "deadline": 0}
        self.hold_s = 0.05  # moving average of how long a call holds a slot
        self.held: dict[str | None, int] = {}  # slots per owner
        self._queues: dict[str | None, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._queued = 0
        self._seq = 0  # arrival order across the owners' queues

    @property
    def queued(self) -> int:
        return self._queued

    def _free(self) -> bool:
        return self.limit <= 0 or self.inflight < self.limit

    def _take(self, owner: str | None) -> None:
        self.inflight += 1
        self.inflight_peak = max(self.inflight_peak, self.inflight)
        self.held[owner] = self.held.get(owner, 0) + 1

    def _give_back(self, owner: str | None) -> None:
        left = self.held.get(owner, 0) - 1
        if left > 0:
            self.held[owner] = left
        else:
            self.held.pop(owner, None)

    async def acquire(self, deadline: float, owner: str | None = None) -> bool:
        """Take a slot for `owner`, waiting in line until `deadline` (monotonic); else raise
        Overloaded. Returns whether the call had to wait.
        """
        if self._free() and not self._queued:
            self._take(owner)
            return False
        if self.max_queue and self._queued >= self.max_queue and not self._evict_for(owner):
            raise self._reject("queue_full")
        waiter = asyncio.get_running_loop().create_future()
        self._seq += 1
        self._queues.setdefault(owner, deque()).append((self._seq, waiter))
        self._queued += 1
        self.queue_peak = max(self.queue_peak, self._queued)
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                await waiter
            return True
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return True  # handed a slot as the deadline struck: it is ours
            self._drop(owner, waiter)
            raise self._reject("deadline") from None
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.done() and not waiter.cancelled():
                self.release(owner)
            self._drop(owner, waiter)
            raise

    def release(self, owner: str | None = None, held_s: float | None = None) -> None:
        """Give `owner`'s slot back: to the next waiter (`_next`) if any, else to the pool."""
        if held_s is not None:
            self.hold_s += 0.1 * (held_s - self.hold_s)
        self._give_back(owner)
        while self._queued and (self.limit <= 0 or self.inflight <= self.limit):
            nxt, waiter = self._next()
            if not waiter.done():  # (done: cancelled, its task about to leave the line)
                self.held[nxt] = self.held.get(nxt, 0) + 1
                waiter.set_result(None)  # the slot passes over; inflight is unchanged
                return
        self.inflight -= 1  # (over a shrunk limit: this slot goes, the waiters wait)

    def wake(self) -> None:
        """Admit waiters into slots a raised limit made free."""
        while self._queued and self._free():
            owner, waiter = self._next()
            if not waiter.done():
                self._take(owner)
                waiter.set_result(None)

    def _next(self) -> tuple[str | None, asyncio.Future[None]]:
        """Take the waiter a slot goes to: the oldest of an owner under its share, else the
        oldest. The caller makes sure one waits. Looks at each owner's first waiter only."""
        cap = self.share * self.limit if self.share < 1 and self.limit > 0 else None
        oldest = fair = None
        for owner, line in self._queues.items():
            seq = line[0][0]
            if oldest is None or seq < oldest[0]:
                oldest = (seq, owner)
            under = cap is not None and self.held.get(owner, 0) < max(1, cap)
            if under and (fair is None or seq < fair[0]):
                fair = (seq, owner)
        assert oldest is not None
        owner = (fair or oldest)[1]
        line = self._queues[owner]
        _, waiter = line.popleft()
        if not line:
            del self._queues[owner]
        self._queued -= 1
        return owner, waiter

    def _evict_for(self, owner: str | None) -> bool:
        """Make room in a full queue for `owner` if it has less than its share of the places:
        the newest waiter of the owner with the most places past its share is turned away
        (429 `queue_full`, as if it had found the queue full). Whether room was made."""
        if self.share >= 1:
            return False
        fair = max(1, int(self.share * self.max_queue))
        if len(self._queues.get(owner, ())) >= fair:
            return False
        hog = max(self._queues, key=lambda o: len(self._queues[o]))
        line = self._queues[hog]
        if hog == owner or len(line) <= fair:
            return False
        _, waiter = line.pop()
        self._queued -= 1
        waiter.set_exception(self._reject("queue_full"))
        return True

    def retry_after_s(self) -> float:
        """The wait a caller turned away now may expect: the line ahead, slot by slot."""
        slots = self.limit if self.limit > 0 else max(1, self.inflight)
        wait = (self._queued + 1) * self.hold_s / slots
        wait *= 1 + 0.5 * random.random()
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait))

    def _drop(self, owner: str | None, waiter: asyncio.Future[None]) -> None:
        """A waiter that gave up leaves its line (a no-op if it was already taken out)."""
        waiter.cancel()
        line = self._queues.get(owner)
        if line is None:
            return
        for i, (_, w) in enumerate(line):
            if w is waiter:
                del line[i]
                self._queued -= 1
                if not line:
                    del self._queues[owner]
                return

    def _reject(self, reason: str) -> Overloaded:
        self.rejected[reason] += 1
        return Overloaded(self.name, reason, self.retry_after_s())


def _loop_time(deadline: float) -> float:
    """A `time.monotonic()` deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


class AdaptiveLimit:
    """Moves a limiter's limit by the event loop's lag (see the module docstring)."""

    def __init__(self, limiter: Limiter, cfg: OverloadConfig) -> None:
        self.limiter = limiter
        self.cfg = cfg
        self.lag_s = 0.0

    def observe(self, lag_s: float) -> None:
        """One tick: the loop's lag just measured."""
        self.lag_s += 0.5 * (lag_s - self.lag_s)
        lim, cfg = self.limiter, self.cfg
        if self.lag_s > cfg.lag_target_s:
            lim.limit = max(cfg.min_inflight, int(lim.limit * 0.8))
        elif lim.inflight >= lim.limit * 0.9 or lim.queued:  # in use: room to grow
            lim.limit = min(cfg.max_inflight, lim.limit + max(1, math.ceil(lim.limit * 0.05)))
            lim.wake()

    async def run_forever(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.cfg.tick_s)
            self.observe(max(0.0, time.monotonic() - start - self.cfg.tick_s))


class OverloadGuard:
    """Every scope's limiter in this process; `scopes` picks those of one call."""

    def __init__(self, cfg: OverloadConfig) -> None:
        self.cfg = cfg
        start = min(max(cfg.min_inflight, 64), cfg.max_inflight) if cfg.max_inflight else 0
        self.process = Limiter("process", start, cfg.max_queue, cfg.run_share)
        self.adaptive = (
            AdaptiveLimit(self.process, cfg)
            if cfg.max_inflight and cfg.min_inflight < cfg.max_inflight
            else None
        )
        self.limiters: dict[str, Limiter] = {}
        self.abandoned = 0  # calls whose client left while they waited: never started
        self._backends: dict[str, str] = {}  # run id -> backend scope

    def scopes(self, run: Run | None) -> list[Limiter]:
        """The limiters a call takes, in order: its run's, its backend's, the process's."""
        out = []
        if run is not None:
            backend = self._backends.get(run.id)
            if backend is None:
                backend = self._backends[run.id] = backend_scope(run)
                if len(self._backends) > 100_000:
                    self._backends.clear()
            if self.cfg.max_inflight_per_run:
                out.append(self._limiter(f"run:{run.id}", self.cfg.max_inflight_per_run))
            if self.cfg.max_inflight_per_backend:
                out.append(
                    self._limiter(backend, self.cfg.max_inflight_per_backend, self.cfg.run_share)
                )
        out.append(self.process)
        return out

    def _limiter(self, name: str, limit: int, share: float = 1.0) -> Limiter:
        lim = self.limiters.get(name)
        if lim is None:
            lim = self.limiters[name] = Limiter(name, limit, self.cfg.max_queue, share)
        return lim

    def all(self) -> list[Limiter]:
        return [self.process, *self.limiters.values()]


class OverloadCollector(Collector):
    """The guard's limiters as Prometheus families, labelled by scope."""

    def __init__(self, guard: OverloadGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "limit": "slots of the scope (the process's adapts)",
            "inflight": "sampling calls holding a slot",
            "queued": "sampling calls waiting for a slot",
            "inflight_peak": "most calls ever holding a slot at once",
            "queue_peak": "most calls ever waiting at once",
        }
        limiters = self.guard.all()
        for name, doc in gauges.items():
            fam = GaugeMetricFamily(f"rlgate_overload_{name}", doc, labels=["scope"])
            for lim in limiters:
                fam.add_metric([lim.name], getattr(lim, name))
            yield fam
        rejected = CounterMetricFamily(
            "rlgate_overload_rejected", "calls answered 429 overloaded", labels=["scope", "reason"]
        )
        for lim in limiters:
            for reason, n in lim.rejected.items():
                rejected.add_metric([lim.name, reason], n)
        yield rejected
        yield CounterMetricFamily(
            "rlgate_overload_abandoned",
            "calls whose client left while they waited for a slot",
            value=self.guard.abandoned,
        )


def backend_scope(run: Run) -> str:
    """The backend a run samples from in this process: a shared in-process LoRA base
    (`BackendPool._load_lora`), else one of its own."""
    lora = (run.config or {}).get("lora_rank") is not None
    if lora and not registry.get(run.backend).remote:
        return f"base:{run.backend}:{run.model_path}"
    return f"backend:{run.id}"


class SlotLease:
    """The slots one sampling call holds, in the order it took them.

    `stepped_out()` gives them back while the call waits on something other than
    this process's capacity (its run's admission, `gateway.control.admission`),
    and takes them again, in line like any call, when that wait ends. Without it a
    run whose trainer is behind would hold every slot of the process with calls
    that only wait, and fair share could not help: it never preempts.
    """

    def __init__(self, guard: OverloadGuard, owner: str | None) -> None:
        self.guard = guard
        self.owner = owner
        self.held: list[Limiter] = []

    async def take(self, limiters: list[Limiter]) -> bool:
        """Take each limiter's slot within one queue deadline; whether any had to wait.
        On Overloaded (or cancellation) nothing is held."""
        deadline = time.monotonic() + self.guard.cfg.queue_timeout_s
        waited = False
        try:
            for limiter in limiters:
                waited |= await limiter.acquire(deadline, self.owner)
                self.held.append(limiter)
        except BaseException:
            self.release()
            raise
        return waited

    def release(self, held_s: float | None = None) -> None:
        for limiter in reversed(self.held):
            limiter.release(self.owner, held_s)
        self.held = []

    @contextlib.asynccontextmanager
    async def stepped_out(self) -> AsyncIterator[None]:
        """Hold no slot inside; on a normal exit take them again (429 `overloaded` past the
        queue deadline). An exception from inside propagates with nothing held."""
        limiters = self.held
        self.release()
        yield
        try:
            await self.take(limiters)
        except Overloaded as exc:
            raise overloaded_error(exc) from None


_LEASE: contextvars.ContextVar[SlotLease | None] = contextvars.ContextVar(
    "rlgate_slot_lease", default=None
)


@contextlib.asynccontextmanager
async def slots_stepped_out() -> AsyncIterator[None]:
    """The current call's slots given back for the `async with` body (no-op outside a call
    that holds any, e.g. in-process callers and tests)."""
    lease = _LEASE.get()
    if lease is None:
        yield
        return
    async with lease.stepped_out():
        yield


class OverloadMiddleware:
    """ASGI middleware: a slot per scope for each sampling call, or a quick 429."""

    def __init__(self, app: ASGIApp, guard: OverloadGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_sampling_call(scope):
            await self.app(scope, receive, send)
            return
        # AgentKeyCheck (middleware.identity) ran first: a call here has a valid key and its run
        run: Run | None = scope.get("state", {}).get("run")
        lease = SlotLease(self.guard, run.id if run is not None else None)
        try:
            waited = await lease.take(self.guard.scopes(run))
        except Overloaded as exc:
            await _too_busy(exc, scope, receive, send)
            return
        start = time.monotonic()
        token = _LEASE.set(lease)
        try:
            if waited:  # a client that gave up while its call waited gets no work done
                first = await receive()
                if first["type"] == "http.disconnect":
                    self.guard.abandoned += 1
                    # nobody reads it; logged and counted as nginx's "client closed request"
                    await Response(status_code=CLIENT_CLOSED)(scope, receive, send)
                    return
                receive = _replay(first, receive)
            await self.app(scope, receive, send)
        finally:
            _LEASE.reset(token)
            lease.release(time.monotonic() - start)


def _replay(first: Message, receive: Receive) -> Receive:
    """`receive` with `first`, already read, handed out again first."""
    pending: list[Message] = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def overloaded_error(exc: Overloaded) -> RateLimited:
    """The 429 `overloaded` a caller turned away by `exc` gets."""
    full = "its queue is full" if exc.reason == "queue_full" else "no slot freed in time"
    return RateLimited(
        f"the gateway is at capacity ({exc.scope}: {full}); retry after {exc.retry_after_s:.1f} s",
        retry_after_s=max(1, math.ceil(exc.retry_after_s)),
        code="overloaded",
    )


async def _too_busy(exc: Overloaded, scope: Scope, receive: Receive, send: Send) -> None:
    response = error_response(overloaded_error(exc), scope["path"])
    response.headers["retry-after-ms"] = str(round(exc.retry_after_s * 1000))
    await response(scope, receive, send)
