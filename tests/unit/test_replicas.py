"""ReplicaSet over in-process fake backends: routing, stickiness, failover, health, rolling swap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inference import registry
from inference.backend import BackendError, BackendOverloaded
from inference.replicas import ReplicaConfig, ReplicaSet, shared_policy
from inference.types import DRAIN, KEEP, GenerateRequest, GenerateResult, SamplingParams, SwapPolicy

PROMPT = [1, 2, 3]


class FakeStream:
    def __init__(self, backend: FakeBackend, request: GenerateRequest) -> None:
        self.backend, self.request = backend, request
        self.cancelled = False
        self.sent: list[tuple[int, float]] = []
        self.failure: BackendError | None = None

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        b = self.backend
        b.active += 1
        try:
            for i in range(self.request.params.max_tokens):
                if b.fail_after_tokens is not None and i >= b.fail_after_tokens:
                    raise BackendError(f"{b.name} died mid-stream")
                if self.cancelled:
                    return
                await asyncio.sleep(b.delay)
                item = (b.token, -0.5)
                self.sent.append(item)
                yield item
        finally:
            b.active -= 1

    def cancel(self) -> None:
        self.cancelled = True

    async def result(self) -> GenerateResult:
        ids = [t for t, _ in self.sent]
        finish = "cancelled" if self.cancelled else "length"
        return GenerateResult(ids, [lp for _, lp in self.sent], finish, self.backend.version)


class FakeBackend:
    """Answers `token` repeatedly; can fail, be unhealthy, be slow; records what it did."""

    def __init__(self, name: str, token: int, version: int = 0, delay: float = 0.0) -> None:
        self.name, self.token, self._version, self.delay = name, token, version, delay
        self.healthy = True
        self.fail: type[BackendError] | None = None
        self.fail_after_tokens: int | None = None
        self.calls = 0
        self.active = 0
        self.loads: list[int] = []
        self.policies: list[SwapPolicy] = []
        self.events: list[tuple[str, str]] | None = None
        self.gate: asyncio.Event | None = None  # when set, generate waits on it
        self.load_gate: asyncio.Event | None = None  # when set, load_weights waits on it
        self.active_at_load: list[int] = []  # requests in flight when each load began

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calls += 1
        if self.fail is not None:
            raise self.fail(f"{self.name} failed")
        self.active += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        n = request.params.max_tokens
        return GenerateResult([self.token] * n, [-0.5] * n, "length", self._version)

    def start_stream(self, request: GenerateRequest) -> FakeStream:
        self.calls += 1
        return FakeStream(self, request)

    async def load_weights(
        self, checkpoint_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        if self.events is not None:
            self.events.append(("load-start", self.name))
        if policy.mode == "drain":
            assert self.active == 0, "a replica must be drained before it reloads"
        self.policies.append(policy)
        self.active_at_load.append(self.active)
        if self.load_gate is not None:
            await self.load_gate.wait()
        await asyncio.sleep(0.05)
        self._version = version
        self.loads.append(version)
        if self.events is not None:
            self.events.append(("load-end", self.name))

    async def health(self) -> bool:
        return self.healthy

    async def close(self) -> None:
        pass


def req(affinity: str | None = None, n: int = 2) -> GenerateRequest:
    return GenerateRequest(PROMPT, SamplingParams(max_tokens=n), affinity=affinity)


def make(*backends: FakeBackend, **cfg) -> ReplicaSet:
    config = ReplicaConfig(**{"health_interval_s": 0.05, **cfg})
    return ReplicaSet([(b.name, b, f"http://{b.name}") for b in backends], config)


async def test_least_outstanding_routing_spreads_concurrent_load() -> None:
    a, b, c = (FakeBackend(n, t, delay=0.05) for n, t in (("a", 1), ("b", 2), ("c", 3)))
    rs = make(a, b, c)
    results = await asyncio.gather(*(rs.generate(req()) for _ in range(9)))
    assert (a.calls, b.calls, c.calls) == (3, 3, 3)
    assert sorted(r.output_token_ids[0] for r in results) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(s["outstanding"] == 0 for s in rs.replica_status())
    await rs.close()


async def test_busy_replica_is_avoided() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.gate = asyncio.Event()
    rs = make(a, b)
    first = asyncio.create_task(rs.generate(req()))  # a (tie broken by order)
    await asyncio.sleep(0.01)
    second = await rs.generate(req())
    assert second.output_token_ids[0] == 2, "the idle replica takes the next request"
    a.gate.set()
    assert (await first).output_token_ids[0] == 1
    await rs.close()


async def test_episode_sticks_to_its_replica_until_it_is_much_busier() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    rs = make(a, b, sticky_slack=1)
    home = (await rs.generate(req("ep-1"))).output_token_ids[0]
    await rs.generate(req("other"))  # spreads: the other replica has served less
    for _ in range(5):
        assert (await rs.generate(req("ep-1"))).output_token_ids[0] == home
    # Load the home replica with 2 waiting requests: beyond the slack, the episode moves.
    busy = a if home == 1 else b
    busy.gate = asyncio.Event()
    waiting = [asyncio.create_task(rs.generate(req("ep-1"))) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert busy.active == 2, "within the slack, the episode stayed home"
    moved = (await rs.generate(req("ep-1"))).output_token_ids[0]
    assert moved != home
    busy.gate.set()
    await asyncio.gather(*waiting)
    # and it stays on its new home
    assert (await rs.generate(req("ep-1"))).output_token_ids[0] == moved
    await rs.close()


async def test_failover_before_result_retries_on_another_replica() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.fail, a.healthy = BackendError, False  # a crashed: requests fail, health fails
    rs = make(a, b)
    out = [await rs.generate(req()) for _ in range(4)]
    assert all(r.output_token_ids[0] == 2 for r in out)
    assert a.calls == 1, "a is taken out after its first failure"
    status = {s["name"]: s for s in rs.replica_status()}
    assert status["a"]["healthy"] is False and "a failed" in status["a"]["last_error"]
    await rs.close()


async def test_request_error_on_healthy_replica_does_not_take_it_out() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.fail = BackendError  # fails requests but answers health: keeps routing
    rs = make(a, b)
    assert (await rs.generate(req())).output_token_ids[0] == 2
    assert all(s["healthy"] for s in rs.replica_status())
    await rs.close()


async def test_attempts_are_bounded_and_the_last_error_is_raised() -> None:
    backends = [FakeBackend(n, 1) for n in "abcd"]
    for b in backends:
        b.fail = BackendError
    rs = make(*backends, max_attempts=2)
    with pytest.raises(BackendError):
        await rs.generate(req())
    assert sum(b.calls for b in backends) == 2
    await rs.close()


async def test_overloaded_replica_is_skipped_but_kept() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.fail = BackendOverloaded
    rs = make(a, b)
    assert (await rs.generate(req())).output_token_ids[0] == 2
    assert {s["name"]: s["healthy"] for s in rs.replica_status()} == {"a": True, "b": True}
    b.fail = BackendOverloaded
    with pytest.raises(BackendOverloaded):
        await rs.generate(req())
    await rs.close()


async def test_no_healthy_replica_raises_backend_error() -> None:
    a = FakeBackend("a", 1)
    a.healthy, a.fail = False, BackendError
    rs = make(a)
    with pytest.raises(BackendError):
        await rs.generate(req())
    with pytest.raises(BackendError, match="no healthy"):
        await rs.generate(req())
    with pytest.raises(BackendError, match="no healthy"):
        rs.start_stream(req())
    await rs.close()


async def test_stream_fails_over_before_the_first_token() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.fail_after_tokens, a.healthy = 0, False
    rs = make(a, b)
    stream = rs.start_stream(req(n=3))
    got = [t async for t, _ in stream.tokens()]
    assert got == [2, 2, 2]
    result = await stream.result()
    assert result.output_token_ids == [2, 2, 2]
    assert a.calls == 1 and b.calls == 1
    await rs.close()


async def test_stream_is_not_retried_after_a_token_was_delivered() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.fail_after_tokens, a.healthy = 2, False
    rs = make(a, b)
    stream = rs.start_stream(req(n=5))
    got: list[int] = []
    with pytest.raises(BackendError, match="mid-stream"):
        async for t, _ in stream.tokens():
            got.append(t)
    assert got == [1, 1], "the consumer saw only the first replica's tokens"
    assert b.calls == 0, "a stream that delivered tokens is never replayed elsewhere"
    with pytest.raises(BackendError):
        await stream.result()
    assert {s["name"]: s["outstanding"] for s in rs.replica_status()} == {"a": 0, "b": 0}
    await rs.close()


async def test_stream_result_without_iterating_and_cancel() -> None:
    a = FakeBackend("a", 7, delay=0.01)
    rs = make(a)
    assert (await rs.start_stream(req(n=3)).result()).output_token_ids == [7, 7, 7]
    stream = rs.start_stream(req(n=50))
    async for _ in stream.tokens():
        stream.cancel()
    result = await stream.result()
    assert result.finish_reason == "cancelled" and len(result.output_token_ids) == 1
    await rs.close()


async def test_health_checks_take_a_replica_out_and_put_it_back() -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    rs = make(a, b)
    rs.start()
    a.healthy = False
    await asyncio.sleep(0.2)
    assert [s["healthy"] for s in rs.replica_status()] == [False, True]
    assert [(await rs.generate(req())).output_token_ids[0] for _ in range(3)] == [2, 2, 2]
    a.healthy = True
    await asyncio.sleep(0.2)
    assert [s["healthy"] for s in rs.replica_status()] == [True, True]
    got = {(await rs.generate(req())).output_token_ids[0] for _ in range(4)}
    assert got == {1, 2}
    await rs.close()


async def test_returning_replica_first_loads_the_newest_weights(tmp_path: Path) -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    rs = make(a, b)
    rs.start()
    a.healthy = False
    await asyncio.sleep(0.2)
    await rs.load_weights(tmp_path, 3)
    assert (a.loads, b.loads) == ([], [3]), "a replica out of routing is skipped"
    assert rs.version == 3, "the version is the lowest one a routable replica serves"
    a.healthy = True
    await asyncio.sleep(0.3)
    assert a.loads == [3] and a.version == 3
    assert [s["healthy"] for s in rs.replica_status()] == [True, True]
    await rs.close()


async def test_rolling_load_keeps_serving_and_results_carry_their_version(tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []
    backends = [FakeBackend(n, i, delay=0.02) for i, n in enumerate("abc")]
    for b in backends:
        b.events = events
    rs = make(*backends)
    served: list[GenerateResult] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            served.append(await rs.generate(req()))
            events.append(("served", str(served[-1].output_token_ids[0])))

    clients = [asyncio.create_task(client()) for _ in range(4)]
    await asyncio.sleep(0.05)
    await rs.load_weights(tmp_path, 1, DRAIN)
    stop.set()
    await asyncio.gather(*clients)
    assert [b.loads for b in backends] == [[1], [1], [1]]
    assert all(b.policies == [DRAIN] for b in backends), "each replica gets the set's policy"
    loads = [e for e in events if e[0].startswith("load")]
    assert loads == [(k, n) for n in "abc" for k in ("load-start", "load-end")], "one at a time"
    # Requests kept being served while each replica reloaded (no global pause).
    for name in "abc":
        start = events.index(("load-start", name))
        end = events.index(("load-end", name))
        assert any(e[0] == "served" for e in events[start:end]), f"no request served during {name}"
    # Mixed versions during the roll: each result carries its replica's version.
    versions = {r.policy_version for r in served}
    assert versions == {0, 1}
    assert rs.version == 1
    # A repeated load of the same version is a no-op.
    await rs.load_weights(tmp_path, 1, DRAIN)
    assert [b.loads for b in backends] == [[1], [1], [1]]
    await rs.close()


async def test_keep_reloads_in_place_and_routes_new_calls_to_the_others(tmp_path: Path) -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    a.gate, a.load_gate = asyncio.Event(), asyncio.Event()
    rs = make(a, b)
    on_a = asyncio.create_task(rs.generate(req()))
    while a.active == 0:
        await asyncio.sleep(0)
    roll = asyncio.create_task(rs.load_weights(tmp_path, 1))  # keep is the default
    while not a.active_at_load:
        await asyncio.sleep(0)
    assert a.active_at_load == [1], "keep does not wait for a's request before reloading"
    # a is paused for its reload: every new call goes to b and finishes meanwhile
    during = await asyncio.gather(*(rs.generate(req()) for _ in range(3)))
    assert [r.output_token_ids[0] for r in during] == [2, 2, 2] and not on_a.done()
    assert [s["loading"] for s in rs.replica_status()] == [True, False]
    a.load_gate.set()
    a.gate.set()
    await roll
    assert (await on_a).output_token_ids[0] == 1
    assert (a.policies, b.policies) == ([KEEP], [KEEP]) and rs.version == 1
    await rs.close()


class FakeAdapterBackend(FakeBackend):
    """A FakeBackend that also serves LoRA adapters; `load_gate` holds an adapter load."""

    def __init__(self, name: str, token: int) -> None:
        super().__init__(name, token)
        self.adapters: dict[str, int] = {}
        self.adapter_policies: list[SwapPolicy] = []

    def adapter_version(self, name: str) -> int | None:
        return self.adapters.get(name)

    async def load_adapter(
        self, name: str, adapter_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        self.adapter_policies.append(policy)
        if self.load_gate is not None:
            await self.load_gate.wait()
        self.adapters[name] = version

    async def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)


async def test_a_keep_adapter_load_routes_the_replicas_other_calls_around_it(
    tmp_path: Path,
) -> None:
    """A keep-mode adapter load pauses the replica's whole server: base-model calls made
    meanwhile go to the other replica; with drain they may still go to it."""
    a, b = FakeAdapterBackend("a", 1), FakeAdapterBackend("b", 2)
    rs = make(a, b)
    await rs.load_adapter("x", tmp_path, 1)
    a.load_gate = asyncio.Event()
    load = asyncio.create_task(rs.load_adapter("x", tmp_path, 2))  # keep: default
    while not a.adapter_policies[1:]:
        await asyncio.sleep(0)
    during = await asyncio.gather(*(rs.generate(req()) for _ in range(3)))
    assert [r.output_token_ids[0] for r in during] == [2, 2, 2]
    a.load_gate.set()
    await load
    assert (a.adapter_policies, b.adapter_policies) == ([KEEP, KEEP], [KEEP, KEEP])
    a.load_gate = asyncio.Event()
    load = asyncio.create_task(rs.load_adapter("x", tmp_path, 3, DRAIN))
    while not a.adapter_policies[2:]:
        await asyncio.sleep(0)
    during = await asyncio.gather(*(rs.generate(req()) for _ in range(3)))
    assert {r.output_token_ids[0] for r in during} == {1, 2}, "drain leaves a's base calls"
    a.load_gate.set()
    await load
    assert rs.adapter_version("x") == 3
    await rs.close()


async def test_single_replica_reloads_in_place(tmp_path: Path) -> None:
    a = FakeBackend("a", 1)
    rs = make(a)
    await rs.load_weights(tmp_path, 2)
    assert a.loads == [2] and rs.version == 2
    assert (await rs.generate(req())).policy_version == 2
    await rs.close()


async def test_add_and_remove_replica(tmp_path: Path) -> None:
    a = FakeBackend("a", 1)
    rs = make(a)
    await rs.load_weights(tmp_path, 4)
    b = FakeBackend("b", 2)
    await rs.add_replica("b", b, "http://b")
    assert b.loads == [4], "a new replica gets the set's weights before it serves"
    assert {(await rs.generate(req())).output_token_ids[0] for _ in range(4)} == {1, 2}
    down = FakeBackend("down", 3)
    down.healthy = False
    await rs.add_replica("down", down)
    assert down.loads == [] and not rs.replica_status()[-1]["healthy"]
    await rs.remove_replica("down")
    await rs.remove_replica("a")
    assert [s["name"] for s in rs.replica_status()] == ["b"]
    with pytest.raises(ValueError):
        await rs.remove_replica("b")
    await rs.close()


async def test_failed_load_keeps_old_weights_and_backs_off(tmp_path: Path) -> None:
    a, b = FakeBackend("a", 1), FakeBackend("b", 2)
    calls: list[str] = []

    async def broken(checkpoint_dir: Path, version: int, policy: SwapPolicy = KEEP) -> None:
        calls.append("a")
        raise BackendError("bad checkpoint")

    a.load_weights = broken  # type: ignore[method-assign]
    rs = make(a, b, load_retry_s=3600)
    with pytest.raises(BackendError, match="could not load"):
        await rs.load_weights(tmp_path, 1)
    assert calls == ["a"] and b.loads == [1]
    status = {s["name"]: s for s in rs.replica_status()}
    assert status["a"]["healthy"] and "bad checkpoint" in status["a"]["last_error"]
    assert rs.version == 0, "a still serves version 0, and says so"
    assert {(await rs.generate(req())).policy_version for _ in range(4)} == {0, 1}
    with pytest.raises(BackendError):  # the weight sync's next pass: no new attempt yet
        await rs.load_weights(tmp_path, 1)
    assert calls == ["a"]
    await rs.close()


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        ReplicaConfig(max_attempts=0)
    with pytest.raises(ValueError):
        ReplicaSet([])


def test_a_shared_keep_swap_drains_servers_that_label_no_tokens() -> None:
    """Other clients' requests can only be labelled by the server: SGLang's are drained."""
    vllm = registry.get("vllm").connect_to("http://127.0.0.1:1")
    sglang = registry.get("sglang").connect_to("http://127.0.0.1:1")
    keep_fresh = SwapPolicy(clear_kv=False)
    assert shared_policy(vllm, KEEP) == KEEP and shared_policy(vllm, keep_fresh) == keep_fresh
    assert shared_policy(sglang, KEEP) == DRAIN
    assert shared_policy(sglang, keep_fresh) == SwapPolicy("drain", clear_kv=False)
    assert shared_policy(vllm, DRAIN) == shared_policy(sglang, DRAIN) == DRAIN
