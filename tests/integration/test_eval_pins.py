"""Evaluation calls that pin a kept version (`X-Rlgate-Version`), through a real gateway.

Real processes: a uvicorn gateway (local backend) and a Celery worker on
Redis, PostgreSQL as the store, the `tiny` model. A full-model run and a LoRA
run each train one real step (one rewarded group) to version 1 and serve it.
Then, through the official `openai` client on `/eval/.../v1` with
`X-Rlgate-Version`:

- a greedy call pinned at 0 returns exactly the greedy tokens of a float32
  `from_pretrained` of version 0's checkpoint (the base model, for the LoRA
  run), and one pinned at 1 those of version 1 (the LoRA run: base + adapter
  through peft); the two differ, so each call shows which weights served it;
- the stored completion records the pinned version as `policy_version`;
- a version the run never had, or one pruned (`keep_checkpoints`), is a 400
  `version_not_kept` naming the kept ones;
- a full-model run on vLLM (the stand-in server, `inference.stub_server`) at
  version 1 answers a pin of version 0 with a 400 `version_pin_unsupported`.
  That run's version 1 is written the way the trainer commits one (checkpoint
  directory, `policy_versions` row, `runs.current_version` advanced in one
  transaction): the stand-in has no model to train on.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psycopg
import pytest
import torch

from core.settings import Settings
from inference.models import resolve_model
from rlgate.stack import free_port, stop, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = {
    "group_size": 2,
    "groups_per_step": 1,
    "micro_batch_size": 2,
    "learning_rate": 5e-2,  # one step moves the tiny model's greedy answer
}
LORA_CONFIG = {**CONFIG, "lora_rank": 4}
FULL_CONFIG = {**CONFIG, "keep_checkpoints": 1}
MESSAGES = [{"role": "user", "content": "Name three colours."}]
TOKENS = 8


@pytest.fixture(scope="module")
def stack(
    redis_url: str, module_postgres_url: str, model_cache: Path, tmp_path_factory
) -> Iterator:
    from tests.integration.conftest import running_stack

    tmp = tmp_path_factory.mktemp("eval-pins")
    settings = Settings(
        data_dir=tmp / "data",
        database_url=module_postgres_url,
        broker_url=redis_url,
        queue_name=f"train-{tmp.name}",
        admin_key="eval-pins-admin-key",
        dev_mode=False,
        model_cache_dir=model_cache,
        sync_interval_s=0.2,
    )
    with running_stack(settings, tmp) as s:
        yield s


class Run:
    def __init__(self, stack, db: str, created: dict) -> None:
        self.stack, self.db, self.info = stack, db, created
        self.root = created["base_url"].removesuffix("/v1")

    @property
    def id(self) -> str:
        return self.info["run_id"]

    def client(self, path: str, pin: int | None = None) -> openai.OpenAI:
        headers = {} if pin is None else {"X-Rlgate-Version": str(pin)}
        return openai.OpenAI(
            base_url=f"{self.root}{path}/v1",
            api_key=self.info["api_key"],
            max_retries=0,
            default_headers=headers,
        )

    def chat(self, path: str, pin: int | None = None, temperature: float = 0.0):
        return self.client(path, pin).chat.completions.create(
            model=self.info["name"], messages=MESSAGES, max_tokens=TOKENS, temperature=temperature
        )

    def row(self, sql: str, *params: object) -> tuple:
        with psycopg.connect(self.db) as conn:
            return conn.execute(sql, params).fetchone()

    def stored(self, completion_id: str) -> tuple[list[int], list[int], int]:
        import numpy as np

        prompt, output, version = self.row(
            "SELECT prompt_token_ids, output_token_ids, policy_version FROM completions "
            "WHERE id = %s",
            completion_id,
        )
        as_ids = lambda b: np.frombuffer(b, dtype="<i4").tolist()  # noqa: E731
        return as_ids(prompt), as_ids(output), version

    def checkpoint(self, version: int) -> Path:
        (path,) = self.row(
            "SELECT checkpoint_path FROM policy_versions WHERE run_id = %s AND version = %s",
            self.id,
            version,
        )
        return Path(path)

    def served_version(self) -> int | None:
        with self.stack.admin() as admin:
            return admin.get(f"/admin/v1/runs/{self.id}").json()["served_version"]

    def train_one_step(self, target: int) -> None:
        """One group of two sampled answers rewarded 1 and 0, then wait for version `target`."""
        for i, reward in enumerate((1.0, 0.0)):
            path = f"/groups/g{target}/episodes/e{target}-{i}"
            resp = self.chat(path, temperature=1.0)
            self.client(path).post(
                "/rewards", body={"completion_id": resp.id, "reward": reward}, cast_to=object
            )
        deadline = time.monotonic() + 300
        while self.served_version() != target:
            assert time.monotonic() < deadline, f"the run never served version {target}"
            time.sleep(0.3)


def create(stack, db: str, name: str, **body: object) -> Run:
    with stack.admin() as admin:
        r = admin.post("/admin/v1/runs", json={"name": name, "model": "tiny", **body})
    assert r.status_code == 201, r.text
    return Run(stack, db, r.json())


@torch.no_grad()
def reference(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens of float32 transformers on `base` (+ `adapter` through peft)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_pinned_call_is_served_by_that_versions_weights(
    stack, module_postgres_url: str, model_cache: Path, lora: bool
) -> None:
    name = "pins-lora" if lora else "pins-full"
    run = create(stack, module_postgres_url, name, config=LORA_CONFIG if lora else FULL_CONFIG)
    run.train_one_step(1)
    base = resolve_model("tiny", model_cache)

    answers = {}
    for pin in (0, 1):
        resp = run.chat(f"/eval/episodes/pinned-{pin}", pin=pin)
        prompt, output, version = run.stored(resp.id)
        assert version == pin == resp.model_extra["policy_version"]
        status = run.row(
            "SELECT status FROM episodes WHERE run_id = %s AND id = %s", run.id, f"pinned-{pin}"
        )
        assert status == ("eval",)
        if lora:
            expected = reference(base, run.checkpoint(1) if pin else None, prompt, len(output))
        else:
            expected = reference(run.checkpoint(pin) if pin else base, None, prompt, len(output))
        assert output == expected, (pin, output, expected)
        answers[pin] = output
    assert answers[0] != answers[1], "versions 0 and 1 answer alike: the check shows nothing"
    assert run.served_version() == 1  # pinning never moved the run

    with pytest.raises(openai.BadRequestError) as err:
        run.chat("/eval/episodes/pinned-7", pin=7)
    body = err.value.body
    assert body["code"] == "version_not_kept", body
    assert "kept versions: 0, 1" in body["message"], body

    if not lora:  # keep_checkpoints 1: version 2 prunes version 1, which then is not kept
        run.train_one_step(2)
        with pytest.raises(openai.BadRequestError) as err:
            run.chat("/eval/episodes/pinned-pruned", pin=1)
        body = err.value.body
        assert body["code"] == "version_not_kept", body
        assert "kept versions: 0, 2" in body["message"], body


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[str]:
    from inference.stub_server import launch

    port = free_port()
    proc = launch("vllm", port, log=tmp_path / "stub.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop(proc)


def test_a_pin_on_a_full_model_run_on_vllm_is_a_400(
    stack, module_postgres_url: str, model_cache: Path, stand_in: str
) -> None:
    run = create(
        stack, module_postgres_url, "pins-vllm", backend="vllm", replicas=[stand_in], config=CONFIG
    )
    assert run.chat("/eval/episodes/current").model_extra["policy_version"] == 0
    # version 1, committed as the trainer commits one (the module docstring says why)
    ckpt = Path(stack.settings.data_dir) / "pins-vllm-v1"
    shutil.copytree(resolve_model("tiny", model_cache), ckpt)
    with psycopg.connect(module_postgres_url) as conn, conn.transaction():
        moved = conn.execute(
            "UPDATE runs SET current_version = 1 WHERE id = %s AND current_version = 0", (run.id,)
        )
        assert moved.rowcount == 1
        conn.execute(
            "INSERT INTO policy_versions (run_id, version, checkpoint_path, created_at) "
            "VALUES (%s, 1, %s, now())",
            (run.id, str(ckpt)),
        )
    deadline = time.monotonic() + 60
    while True:  # until the servers hold version 1 (a pin of 0 is then another version)
        assert time.monotonic() < deadline, "the gateway never saw version 1"
        try:
            resp = run.chat("/eval/episodes/pinned-0", pin=0)
        except openai.BadRequestError as exc:
            assert exc.body["code"] == "version_pin_unsupported", exc.body
            assert "vllm servers" in exc.body["message"], exc.body
            break
        except openai.ConflictError as exc:  # the swap landed between the check and the send
            assert exc.body["code"] == "version_moved", exc.body
            continue  # what an SDK with retries does; the retry sees version 1
        # answered: by version 0 only, never by the version that replaced it meanwhile
        assert resp.model_extra["policy_version"] == 0
        time.sleep(0.5)
