"""SGLangBackend's collective receive against a stand-in SGLang (no SGLang is installed here).

The stand-in answers `/get_server_info`, `/init_weights_update_group`,
`/update_weights_from_distributed` and `/destroy_weights_update_group` with
the fields of SGLang's `io_struct.py`, and joins the trainer's transfer the
way SGLang's model runner does: a group formed over torch's `tcp://`
rendezvous, one typed broadcast per tensor in the order of `names`. It joins
with rlgate's own helper (`join_named_group`), so what this checks is the
call sequence, the fields sent and rlgate's sender, not SGLang's receiver:
that needs a real SGLang server, which this project has not run.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from inference.backend import BackendError
from inference.http_common import HttpBackendConfig
from inference.sglang_http import SGLangBackend
from inference.types import DRAIN, KEEP, SwapPolicy
from inference.weight_source import CollectiveSource
from inference.weight_wire.rlgate_weight_wire import Rendezvous, join_named_group
from trainer.weight_server import WeightServer


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def _sglang_rank(conn: Connection) -> None:
    """A child process standing in for SGLang's TP rank 0 (a group name is registered once
    per process, and the trainer's side of the group lives in this test's process)."""
    body = conn.recv()
    rdv = Rendezvous(
        body["master_address"], body["master_port"], "", body["world_size"], 0, body["group_name"]
    )
    group = join_named_group(rdv, body["rank_offset"], body["backend"], 60)
    conn.send("joined")
    update = conn.recv()
    received = {}
    for name, dtype, shape in zip(update["names"], update["dtypes"], update["shapes"], strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=group)
        received[name] = t
    conn.send(received)
    conn.recv()  # destroy
    dist.destroy_process_group(group)
    conn.send("destroyed")


class FakeSGLang:
    def __init__(self, fail_update: bool = False) -> None:
        self.calls: list[str] = []
        self.bodies: dict[str, dict] = {}
        self.received: dict[str, torch.Tensor] = {}
        self.fail_update = fail_update
        self.conn: Connection | None = None
        self.child: multiprocessing.process.BaseProcess | None = None

    async def _ask(self, msg: object) -> object:
        self.conn.send(msg)
        return await asyncio.to_thread(self.conn.recv)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        body = json.loads(request.content) if request.content else {}
        self.bodies[path] = body
        if path == "/get_server_info":
            return httpx.Response(200, json={"tp_size": 1, "model_path": "m"})
        if path == "/init_weights_update_group":
            ctx = multiprocessing.get_context("spawn")
            self.conn, child_end = ctx.Pipe()
            self.child = ctx.Process(target=_sglang_rank, args=(child_end,), daemon=True)
            self.child.start()
            assert await self._ask(body) == "joined"
            return httpx.Response(200, json={"success": True, "message": "joined"})
        if path == "/update_weights_from_distributed":
            self.received = await self._ask(body)
            ok = not self.fail_update
            return httpx.Response(200 if ok else 400, json={"success": ok, "message": "x"})
        if path == "/destroy_weights_update_group":
            assert await self._ask(body) == "destroyed"
            self.child.join(30)
            return httpx.Response(200, json={"success": True, "message": ""})
        return httpx.Response(200, json={})


@pytest.fixture
def server() -> WeightServer:
    ws = WeightServer("127.0.0.1", timeout_s=60)
    ws.publish("r1", 4, _state())
    yield ws
    ws.close()


def _backend(fake: FakeSGLang) -> SGLangBackend:
    return SGLangBackend(
        HttpBackendConfig(base_url="http://sglang.test", drain_timeout_s=5),
        transport=httpx.MockTransport(fake.handler),
    )


@pytest.mark.parametrize(
    ("policy", "mode", "flush"),
    [(KEEP, "retract", True), (SwapPolicy(mode="keep", clear_kv=False), "in_place", False)],
    ids=["keep", "keep-kv"],
)
async def test_sglang_joins_the_trainers_group_between_pause_and_continue(
    server: WeightServer, policy: SwapPolicy, mode: str, flush: bool
) -> None:
    """Keep-mode swaps pause with SGLang's `retract` (KV recomputed, cache flushed) or
    `in_place` (KV kept: a flush would fail while requests run, so none is asked for)."""
    fake = FakeSGLang()
    be = _backend(fake)
    await be.load_weights(CollectiveSource(server.url_for("r1"), 4, Path("/nowhere")), 4, policy)
    assert be.version == 4
    assert fake.calls == [
        "/pause_generation",
        "/get_server_info",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/continue_generation",
    ]
    init = fake.bodies["/init_weights_update_group"]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    update = fake.bodies["/update_weights_from_distributed"]
    assert update["group_name"] == init["group_name"] and update["weight_version"] == "4"
    assert update["names"] == list(_state()) and update["dtypes"] == ["float32", "bfloat16"]
    assert update["shapes"] == [[6, 4], [4]] and update["flush_cache"] is flush
    assert fake.bodies["/pause_generation"] == {"mode": mode}
    for name, t in _state().items():
        assert fake.received[name].dtype == t.dtype and torch.equal(fake.received[name], t)
    await be.close()


async def test_a_refused_update_keeps_the_version_and_resumes(server: WeightServer) -> None:
    fake = FakeSGLang(fail_update=True)
    be = _backend(fake)
    with pytest.raises(BackendError, match="update_weights_from_distributed"):
        source = CollectiveSource(server.url_for("r1"), 4, Path("/nowhere"))
        await be.load_weights(source, 4, DRAIN)
    assert be.version == 0
    assert fake.bodies["/pause_generation"] == {}  # drain: SGLang's default pause, as always
    assert fake.calls[-2:] == ["/destroy_weights_update_group", "/continue_generation"]
    await be.close()
