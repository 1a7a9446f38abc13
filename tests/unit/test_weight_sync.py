"""`weight_sync: collective` without an inference server: the gloo wire, the trainer's weight
server, the offer files, the save schedule, and VLLMBackend's receive step against a stand-in
vLLM whose `/collective_rpc` joins real transfers (tests/integration/test_vllm_collective.py
runs the real vLLM)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from inference.backend import BackendError
from inference.http_common import HttpBackendConfig
from inference.launch import ServerConfig, server_command, server_env
from inference.replicas import ReplicaConfig, ReplicaSet
from inference.vllm_http import VLLMBackend
from inference.weight_source import WIRE_DIR, CollectiveSource, offer_path, weights_source
from inference.weight_wire import rlgate_weight_wire as wire
from trainer.config import RunConfig
from trainer.weight_publish import StepWeights, save_due
from trainer.weight_server import WeightServer, hf_state


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 4, generator=g),
        "counter": torch.arange(5),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def test_wire_sends_every_dtype_to_every_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "BUCKET_BYTES", 100)  # several buckets, one tensor each at most
    state = _state()
    assert len(wire.plan(state)) == len(state)
    store, rdv = wire.open_store("127.0.0.1", 2, 5, 60)
    got: dict[int, dict] = {}

    def receive(rank: int) -> None:
        got[rank] = {k: v.clone() for k, v in wire.receive_weights(rdv, rank, 60)}

    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sent = wire.send_weights(store, rdv, wire.pack(state), 60)
    for t in threads:
        t.join(60)
    assert sent >= sum(t.numel() * t.element_size() for t in state.values())
    assert _same(got[1], state) and _same(got[2], state)


def test_plan_aligns_every_tensor() -> None:
    (bucket,) = wire.plan({"a": torch.zeros(3, dtype=torch.int8), "b": torch.zeros(2)})
    assert [t[3] for t in bucket["tensors"]] == [0, wire.ALIGN]


def test_hf_state_sends_a_tied_head_once() -> None:
    emb = torch.nn.Embedding(5, 3)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = emb
    model.lm_head = torch.nn.Linear(3, 5, bias=False)
    model.lm_head.weight = emb.weight  # tied
    assert list(hf_state(model)) == ["model.embed_tokens.weight"]


@pytest.fixture
def server() -> WeightServer:
    ws = WeightServer("127.0.0.1", timeout_s=60)
    yield ws
    ws.close()


def test_weight_server_answers_only_its_newest_version(server: WeightServer) -> None:
    state = _state()
    server.publish("r1", 2, state)
    with torch.no_grad():
        state["model.norm.weight"].add_(1.0)  # the next step moves the weights: not sent
    url = server.url_for("r1") + "/transfers"
    assert httpx.post(url, json={"version": 1, "receivers": 1}).status_code == 409
    assert httpx.post(url, json={"version": 2}).status_code == 400
    assert httpx.post(url, json={"version": 2, "receivers": 0}).status_code == 400
    missing = server.url_for("nope") + "/transfers"
    assert httpx.post(missing, json={"version": 2, "receivers": 1}).status_code == 409
    assert httpx.post(server.url + "/other", json={}).status_code == 404

    resp = httpx.post(url, json={"version": 2, "receivers": 1})
    assert resp.status_code == 200, resp.text
    rdv = wire.Rendezvous.from_json(resp.json())
    assert rdv.version == 2 and rdv.world_size == 2
    server.publish("r1", 3, {})  # the next version arrives during the transfer: not mixed in
    assert _same(dict(wire.receive_weights(rdv, 1, 60)), _state())


def test_weights_source_reads_the_offer(tmp_path: Path) -> None:
    ckpt = tmp_path / "v3"
    assert weights_source(ckpt, 3) == ckpt
    offer_path(ckpt).write_text(json.dumps({"url": "http://t:1/runs/r", "version": 3}))
    assert weights_source(ckpt, 3) == CollectiveSource("http://t:1/runs/r", 3, ckpt)
    assert weights_source(ckpt, 4) == ckpt  # an offer of another version
    offer_path(ckpt).write_text("{")
    assert weights_source(ckpt, 3) == ckpt


def test_collective_saves_every_n_versions_and_on_request(tmp_path: Path) -> None:
    cfg = RunConfig(weight_sync="collective", save_every_steps=2)
    assert [save_due(cfg, v) for v in (1, 2, 3, 4)] == [False, True, False, True]
    assert all(save_due(RunConfig(), v) for v in (1, 2, 3))
    weights = StepWeights()
    saves: list[int] = []

    def step(v: int) -> dict:
        def save() -> None:
            (tmp_path / f"v{v}").mkdir()
            (tmp_path / f"v{v}" / "model.safetensors").write_bytes(b"x")
            saves.append(v)

        return weights.after_step("r", cfg, v, tmp_path / f"v{v}", save, _state)

    try:
        assert step(1)["saved"] == 0.0 and saves == []
        assert weights.server is not None and weights.server.version("r") == 1
        offer = json.loads(offer_path(tmp_path / "v1").read_text())
        assert offer == {"url": weights.server.url_for("r"), "version": 1}
        assert weights.save_unsaved("r") == 1 and saves == [1]  # what a pause does
        assert weights.save_unsaved("r") is None
        assert step(2)["saved"] == 1.0 and saves == [1, 2]
        step(3)
        weights.close()  # worker shutdown writes what is unsaved
        assert saves == [1, 2, 3]
    finally:
        weights.close()


def test_collective_needs_full_weights() -> None:
    for bad in ({"lora_rank": 8}, {"engine": "megatron"}):
        with pytest.raises(ValueError, match="weight_sync 'collective' sends full weights"):
            RunConfig(weight_sync="collective", **bad)
    with pytest.raises(ValueError):
        RunConfig(save_every_steps=0)


class FakeVLLM:
    """The control API of a vLLM server with rlgate's worker extension; `receive_weights`
    joins the transfer for real, as the worker would."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self.calls: list[str] = []
        self.received: dict[int, dict] = {}

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path != "/collective_rpc":
            self.calls.append(path)
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.calls.append(body["method"])
        if body["method"] == "rlgate_worker_rank":
            return httpx.Response(200, json={"results": list(range(self.workers))})
        if body["method"] == "rlgate_receive_weights":
            rdv = wire.Rendezvous.from_json(json.loads(body["kwargs"]["rendezvous"]))

            def join(rank: int) -> dict:
                return {k: v.clone() for k, v in wire.receive_weights(rdv, 1 + rank, 60)}

            got = await asyncio.gather(*(asyncio.to_thread(join, r) for r in range(self.workers)))
            self.received = dict(enumerate(got))
            return httpx.Response(200, json={"results": [{"version": rdv.version}] * self.workers})
        return httpx.Response(200, json={"results": [None]})


def _backend(fake: FakeVLLM) -> VLLMBackend:
    return VLLMBackend(
        HttpBackendConfig(base_url="http://vllm.test", drain_timeout_s=5),
        transport=httpx.MockTransport(fake.handler),
    )


async def test_vllm_receives_between_pause_and_resume(server: WeightServer) -> None:
    server.publish("r1", 1, _state())
    fake = FakeVLLM(workers=2)
    be = _backend(fake)
    await be.load_weights(CollectiveSource(server.url_for("r1"), 1, Path("/nowhere")), 1)
    assert be.version == 1
    assert fake.calls == [
        "/pause",
        "rlgate_worker_rank",
        "rlgate_receive_weights",
        "/weight_info",  # keep mode (the default): read the label, then relabel, still paused
        "/update_weight_version",
        "/resume",
    ]
    assert _same(fake.received[0], _state()) and _same(fake.received[1], _state())
    await be.close()


async def test_a_version_the_trainer_no_longer_holds(server: WeightServer, tmp_path: Path) -> None:
    server.publish("r1", 2, _state())
    fake = FakeVLLM()
    be = _backend(fake)
    gone = CollectiveSource(server.url_for("r1"), 1, tmp_path / "v1")
    with pytest.raises(BackendError, match="409"):  # not saved either: the swap fails
        await be.load_weights(gone, 1)
    assert be.version == 0 and fake.calls[-1] == "/resume"

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "model.safetensors").write_bytes(b"x")
    fake.calls.clear()
    await be.load_weights(gone, 1)  # saved meanwhile: loaded from disk instead
    assert be.version == 1
    assert fake.calls[-4:] == [
        "reload_weights",
        "/weight_info",
        "/update_weight_version",
        "/resume",
    ]
    await be.close()


def test_vllm_servers_start_with_the_worker_extension(tmp_path: Path) -> None:
    cfg = ServerConfig(kind="vllm", model_dir=tmp_path, python=Path(sys.executable))
    cmd = server_command(cfg)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "rlgate_vllm_ext.WeightReceiver"
    env = server_env(cfg)
    assert env["PYTHONPATH"] == str(WIRE_DIR) and env["VLLM_SERVER_DEV_MODE"] == "1"
    # vLLM's interpreter has torch but no rlgate: the extension must need nothing else
    probe = (
        "import sys, rlgate_vllm_ext; "
        "ours = {'inference', 'trainer', 'gateway'}; "
        "assert not any(m.split('.')[0] in ours for m in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


async def test_a_replica_that_joins_late_gets_the_offered_version(server: WeightServer) -> None:
    server.publish("r1", 1, _state())
    first, late = FakeVLLM(), FakeVLLM()
    replicas = ReplicaSet([("a", _backend(first), "http://a")], ReplicaConfig())
    await replicas.load_weights(CollectiveSource(server.url_for("r1"), 1, Path("/nowhere")), 1)
    await replicas.add_replica("b", _backend(late), "http://b")
    status = {r["name"]: r for r in replicas.replica_status()}
    assert status["b"]["healthy"] is True and status["b"]["version"] == 1
    assert "rlgate_receive_weights" in late.calls and _same(late.received[0], _state())
    await replicas.close()


def test_publish_reuses_the_older_snapshot_unless_a_transfer_reads_it(
    server: WeightServer,
) -> None:
    server.publish("r", 1, _state())
    first = server._snapshots["r"][1]
    server.publish("r", 2, _state())
    second = server._snapshots["r"][1]
    assert second.bufs[0] is first.bufs[0]  # no transfer read v1: its pages are reused
    rdv = wire.Rendezvous.from_json(server.open("r", 2, 1))
    moved = {k: v + 1 if v.is_floating_point() else v for k, v in _state().items()}
    server.publish("r", 3, moved)  # v2 is being sent: v3 gets buffers of its own
    assert server._snapshots["r"][1].bufs[0] is not second.bufs[0]
    assert _same(dict(wire.receive_weights(rdv, 1, 60)), _state())  # v2 arrives whole
