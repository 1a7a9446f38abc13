"""Overload control: slots, the bounded FIFO, the deadline, the adaptive limit and the 429."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.errors import RateLimited
from gateway.middleware import overload
from gateway.middleware.overload import (
    AdaptiveLimit,
    Limiter,
    OverloadConfig,
    Overloaded,
    OverloadGuard,
    OverloadMiddleware,
    SlotLease,
    slots_stepped_out,
)

FAR = 3600.0  # a deadline that never strikes in these tests


def later() -> float:
    return time.monotonic() + FAR


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_freed_slot_goes_to_the_oldest_waiter_and_a_full_queue_is_refused() -> None:
    lim = Limiter("t", limit=1, max_queue=2)
    await lim.acquire(later())
    order: list[str] = []

    async def wait(name: str) -> None:
        await lim.acquire(later())
        order.append(name)

    b = asyncio.create_task(wait("b"))
    await _settle()
    c = asyncio.create_task(wait("c"))
    await _settle()
    assert lim.queued == 2 and lim.queue_peak == 2
    with pytest.raises(Overloaded) as refused:
        await lim.acquire(later())
    assert refused.value.reason == "queue_full" and lim.rejected["queue_full"] == 1
    lim.release()
    await b
    assert order == ["b"] and lim.inflight == 1  # handed over, never counted twice
    lim.release()
    await c
    lim.release()
    assert order == ["b", "c"] and lim.inflight == 0 and lim.inflight_peak == 1


async def test_a_waiter_past_its_deadline_is_refused_and_leaves_the_line() -> None:
    lim = Limiter("t", limit=1, max_queue=4)
    await lim.acquire(later())
    with pytest.raises(Overloaded) as late:
        await lim.acquire(time.monotonic() + 0.01)
    assert late.value.reason == "deadline" and lim.queued == 0
    lim.release()
    assert lim.inflight == 0


async def test_a_cancelled_waiter_leaks_no_slot() -> None:
    lim = Limiter("t", limit=1, max_queue=4)
    await lim.acquire(later())
    waiter = asyncio.create_task(lim.acquire(later()))
    await _settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    lim.release()
    assert lim.inflight == 0 and lim.queued == 0
    await lim.acquire(later())  # the slot is free again
    assert lim.inflight == 1


async def test_a_shrunk_limit_hands_no_slot_over_until_inflight_fits() -> None:
    lim = Limiter("t", limit=2, max_queue=4)
    await lim.acquire(later())
    await lim.acquire(later())
    waiter = asyncio.create_task(lim.acquire(later()))
    await _settle()
    lim.limit = 1
    lim.release()  # 2 -> 1 in flight: at the new limit, the waiter still waits
    await _settle()
    assert not waiter.done() and lim.inflight == 1
    lim.release()
    await waiter
    assert lim.inflight == 1


def test_retry_after_stays_within_what_the_sdk_honours() -> None:
    lim = Limiter("t", limit=1, max_queue=0)
    lim.hold_s = 1e6
    assert lim.retry_after_s() == 60.0
    lim.hold_s = 0.0
    assert lim.retry_after_s() == 0.1


async def test_the_adaptive_limit_shrinks_on_lag_and_grows_only_while_in_use() -> None:
    cfg = OverloadConfig(max_inflight=100, min_inflight=10, lag_target_s=0.02)
    lim = Limiter("process", limit=50, max_queue=0)
    ctl = AdaptiveLimit(lim, cfg)
    for _ in range(20):
        ctl.observe(0.5)
    assert lim.limit == 10  # the floor
    for _ in range(50):
        ctl.observe(0.0)
    assert lim.limit == 10  # idle: a limit nobody uses does not grow
    for _ in range(10):
        await lim.acquire(later())
    waiter = asyncio.create_task(lim.acquire(later()))
    await _settle()
    ctl.observe(0.0)  # lag back under target (its average halves each tick) and in use
    ctl.observe(0.0)
    assert lim.limit > 10
    await waiter  # the raised limit admitted the waiter
    assert lim.inflight == 11


def test_the_floor_may_not_exceed_the_ceiling() -> None:
    with pytest.raises(ValueError, match="overload_min_inflight"):
        OverloadConfig(max_inflight=4, min_inflight=8)


def _app(guard: OverloadGuard, gate: asyncio.Event) -> OverloadMiddleware:
    async def chat(request: Request) -> JSONResponse:
        await gate.wait()
        return JSONResponse({"ok": True})

    routes = [Route("/v1/chat/completions", chat, methods=["POST"])]
    routes.append(Route("/v1/rewards", chat, methods=["POST"]))
    return OverloadMiddleware(Starlette(routes=routes), guard=guard)


async def test_the_middleware_answers_a_quick_openai_429_past_the_bound() -> None:
    cfg = OverloadConfig(max_inflight=1, min_inflight=1, max_queue=1, queue_timeout_s=FAR)
    guard = OverloadGuard(cfg)
    gate = asyncio.Event()
    transport = httpx.ASGITransport(app=_app(guard, gate))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", json={}))
        second = asyncio.create_task(client.post("/v1/chat/completions", json={}))
        await _settle()
        assert guard.process.inflight == 1 and guard.process.queued == 1
        third = await client.post("/v1/chat/completions", json={})
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "overloaded"
        assert set(third.json()["error"]) == {"message", "type", "param", "code"}
        assert 100 <= int(third.headers["retry-after-ms"]) <= 60_000
        assert 1 <= int(third.headers["retry-after"]) <= 60
        other = asyncio.create_task(client.post("/v1/rewards", json={}))  # not a sampling call
        await _settle()
        assert guard.process.queued == 1
        gate.set()
        assert [(await t).status_code for t in (first, second, other)] == [200, 200, 200]
    assert guard.process.inflight == 0


async def test_a_call_whose_client_left_while_it_waited_is_never_started() -> None:
    cfg = OverloadConfig(max_inflight=1, min_inflight=1, max_queue=4, queue_timeout_s=FAR)
    guard = OverloadGuard(cfg)
    gate = asyncio.Event()
    started: list[str] = []

    async def app(scope, receive, send) -> None:
        started.append(scope["path"])
        await gate.wait()

    mw = OverloadMiddleware(app, guard=guard)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    sent: list[dict] = []

    async def body() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    first = asyncio.create_task(mw(scope, body, send))
    await _settle()
    second = asyncio.create_task(mw(scope, gone, send))
    await _settle()
    assert guard.process.queued == 1
    gate.set()
    await first
    await second
    assert started == ["/v1/chat/completions"] and guard.abandoned == 1
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [499]
    assert guard.process.inflight == 0


async def test_anthropic_paths_are_turned_away_in_anthropic_shape() -> None:
    cfg = OverloadConfig(max_inflight=1, min_inflight=1, max_queue=1, queue_timeout_s=0.01)
    guard = OverloadGuard(cfg)
    await guard.process.acquire(later())  # the only slot is taken
    transport = httpx.ASGITransport(app=_app(guard, asyncio.Event()))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        resp = await client.post("/episodes/e1/v1/messages", json={})
    assert resp.status_code == 429 and "retry-after-ms" in resp.headers
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
    assert guard.process.rejected["deadline"] == 1


async def test_a_freed_slot_goes_first_to_a_run_under_its_share() -> None:
    lim = Limiter("process", limit=4, max_queue=0, share=0.5)
    for _ in range(4):
        await lim.acquire(later(), "flood")
    flood_waiters = [asyncio.create_task(lim.acquire(later(), "flood")) for _ in range(3)]
    await asyncio.sleep(0)
    quiet = asyncio.create_task(lim.acquire(later(), "quiet"))  # last in line
    await asyncio.sleep(0)
    lim.release("flood")
    await asyncio.sleep(0)
    assert quiet.done() and not any(w.done() for w in flood_waiters)
    assert lim.held == {"flood": 3, "quiet": 1} and lim.inflight == 4
    lim.release("flood")  # nobody else under its share waits: the oldest flood waiter
    await asyncio.sleep(0)
    assert flood_waiters[0].done() and lim.queued == 2
    for w in flood_waiters[1:]:
        w.cancel()
    await asyncio.gather(*flood_waiters[1:], return_exceptions=True)
    assert lim.queued == 0


async def test_a_call_stepped_out_serves_another_run_then_waits_in_line_for_its_slot() -> None:
    """What a call waiting in its run's admission does: the process's one slot serves
    another run meanwhile, and comes back to the waiter, in line, once freed."""
    guard = OverloadGuard(OverloadConfig(max_inflight=1, min_inflight=1, queue_timeout_s=FAR))
    waiter = SlotLease(guard, "a")
    await waiter.take(guard.scopes(None))
    other = SlotLease(guard, "b")
    token = overload._LEASE.set(waiter)
    try:

        async def admission_wait() -> None:
            async with slots_stepped_out():
                await other.take(guard.scopes(None))  # another run's call takes the slot

        back = asyncio.create_task(admission_wait())
        await _settle()
        assert not back.done() and guard.process.queued == 1  # in line for its slot again
        other.release()
        await back
        assert waiter.held == [guard.process] and guard.process.inflight == 1
    finally:
        overload._LEASE.reset(token)
    waiter.release()
    assert guard.process.inflight == 0


async def test_a_failed_wait_leaves_nothing_held_and_a_late_return_is_a_429() -> None:
    guard = OverloadGuard(OverloadConfig(max_inflight=1, min_inflight=1, queue_timeout_s=0.05))
    lease = SlotLease(guard, "a")
    await lease.take(guard.scopes(None))
    token = overload._LEASE.set(lease)
    try:
        with pytest.raises(RateLimited):  # the admission's own 429: nothing to take back
            async with slots_stepped_out():
                raise RateLimited("over capacity", retry_after_s=60)
        assert lease.held == [] and guard.process.inflight == 0
        await lease.take(guard.scopes(None))
        blocker = SlotLease(guard, "b")
        with pytest.raises(RateLimited) as exc:  # the slot stays taken past the deadline
            async with slots_stepped_out():
                await blocker.take(guard.scopes(None))
        assert exc.value.code == "overloaded" and lease.held == []
    finally:
        overload._LEASE.reset(token)
    assert guard.process.inflight == 1  # the blocker's


async def test_a_full_queue_seats_a_run_under_its_share_by_turning_away_the_hog() -> None:
    lim = Limiter("process", limit=1, max_queue=4, share=0.5)
    await lim.acquire(later(), "hog")
    hog = [asyncio.create_task(lim.acquire(later(), "hog")) for _ in range(4)]
    await _settle()
    assert lim.queued == 4  # a run alone may fill the queue
    quiet = asyncio.create_task(lim.acquire(later(), "quiet"))
    await _settle()
    assert lim.queued == 4 and not quiet.done()
    with pytest.raises(Overloaded) as exc:  # the hog's newest waiter made room
        await hog[-1]
    assert exc.value.reason == "queue_full" and lim.rejected["queue_full"] == 1
    # past its share of places the hog cannot push the quiet run out again
    with pytest.raises(Overloaded):
        await lim.acquire(later(), "hog")
    waiting = {quiet: "quiet", **{t: "hog" for t in hog[:-1]}}
    lim.release("hog")
    while waiting:  # every waiter left in the line is served in turn: none was lost
        done, _ = await asyncio.wait(waiting, timeout=1)
        assert len(done) == 1, "exactly one waiter holds the one slot"
        lim.release(waiting.pop(done.pop()))
    assert lim.inflight == 0 and lim.queued == 0
