"""Three LoRA runs on one SmolLM2 in one gateway, each trained on its own rewards.

Real processes: a uvicorn gateway (local backend: one shared base model, one
adapter per run) and a Celery worker on Redis, PostgreSQL as the store.

- Each run trains from its own reward: `favour` (answers that do not start
  with the base model's favourite, "1") until its greedy answer differs from
  the base model's, `short` (shorter answers) and `two` (answers with a "2")
  for a step each.
- After every step only the trained run's version moves, and the other two
  runs' greedy answers are unchanged token for token.
- The trained run's greedy answer is the greedy answer of its merged export
  (`rlgate export --merged`, loaded with plain transformers), and a sampled
  answer's stored logprobs are the merged model's.
- A version's checkpoint is the adapter: its size is printed and asserted far
  below the model's.
- examples/lora_runs.py runs on the same gateway (three more runs, same base).
- Pausing one run answers its agents 429 and leaves the others serving;
  stopping one unloads only its adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from rlgate.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = "Pick a number from 1 to 5. Answer with the number only."
CONFIG = {
    "lora_rank": 8,
    "group_size": 4,
    "groups_per_step": 1,
    "micro_batch_size": 4,
    "learning_rate": 3e-3,  # high for LoRA: a few steps move the greedy answer
    "max_pending_episodes": 256,  # greedy probes are episodes too (never rewarded)
    "zero_variance_groups": "skip",  # a group whose answers all score the same waits
}
SAMPLE_TOKENS = 8
GREEDY_TOKENS = 10
MAX_STEPS = 12
TIE = 1e-4  # logits this close to the maximum count as a greedy choice (float noise)


def _favour(text: str, n_tokens: int) -> float:
    return 0.0 if text.strip().startswith("1") else 1.0


def _short(text: str, n_tokens: int) -> float:
    return -n_tokens / SAMPLE_TOKENS


def _two(text: str, n_tokens: int) -> float:
    return 1.0 if "2" in text else -n_tokens / (10 * SAMPLE_TOKENS)


REWARDS: dict[str, Callable[[str, int], float]] = {
    "favour": _favour,
    "short": _short,
    "two": _two,
}


@dataclass
class LoraRun:
    info: dict
    root: str
    db: str
    waves: int = 0

    @property
    def id(self) -> str:
        return self.info["run_id"]

    def agent(self, path: str = "") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.root}{path}/v1", api_key=self.info["api_key"], max_retries=0
        )

    def stored(self, completion_id: str) -> dict:
        """The completion as the gateway stored it: prompt and output ids, logprobs, version."""
        import numpy as np
        import psycopg

        with psycopg.connect(self.db) as conn:
            ((prompt, output, logprobs, version),) = conn.execute(
                "SELECT prompt_token_ids, output_token_ids, output_logprobs, policy_version "
                "FROM completions WHERE id = %s",
                (completion_id,),
            ).fetchall()
        return {
            "prompt": np.frombuffer(prompt, dtype="<i4").tolist(),
            "output": np.frombuffer(output, dtype="<i4").tolist(),
            "logprobs": np.frombuffer(logprobs, dtype="<f4").tolist(),
            "version": version,
        }

    def ask(self, temperature: float, max_tokens: int, path: str = "") -> dict:
        resp = self.agent(path).chat.completions.create(
            model=self.info["name"],
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=max_tokens,
            temperature=temperature,
        )
        row = self.stored(resp.id)
        assert row["version"] == resp.model_extra["policy_version"]
        return {**row, "text": resp.choices[0].message.content or ""}

    def greedy(self) -> tuple[list[int], int]:
        """The run's greedy answer to PROMPT: (output token ids, policy version)."""
        row = self.ask(0.0, GREEDY_TOKENS, f"/groups/greedy/episodes/greedy-{time.monotonic_ns()}")
        return row["output"], row["version"]

    def wave(self, reward: Callable[[str, int], float]) -> list[float]:
        """One group of sampled answers, each rewarded by `reward`; the rewards."""
        g = self.waves
        self.waves += 1
        rewards = []
        for e in range(CONFIG["group_size"]):
            path = f"/groups/g{g}/episodes/e{g}-{e}"
            resp = self.agent(path).chat.completions.create(
                model=self.info["name"],
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=SAMPLE_TOKENS,
                temperature=1.0,
            )
            r = reward(resp.choices[0].message.content or "", resp.usage.completion_tokens)
            self.agent(path).post(
                "/rewards", body={"completion_id": resp.id, "reward": r}, cast_to=object
            )
            rewards.append(r)
        return rewards


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh PostgreSQL database for this module, dropped afterwards."""
    import uuid

    import psycopg

    from tests.integration.conftest import PG_ADMIN

    name = "rlgate_it_" + uuid.uuid4().hex[:10]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def stack(redis_url: str, database: str, smollm2_cache: Path, tmp_path_factory) -> Iterator:
    from tests.integration.conftest import running_stack

    tmp = tmp_path_factory.mktemp("lora")
    settings = Settings(
        data_dir=tmp / "data",
        database_url=database,
        broker_url=redis_url,
        queue_name=f"train-{tmp.name}",
        admin_key="lora-admin-key",
        dev_mode=False,
        model_cache_dir=smollm2_cache,
        sync_interval_s=0.2,
    )
    with running_stack(settings, tmp) as s:
        yield s


@pytest.fixture(scope="module")
def runs(stack, database: str) -> dict[str, LoraRun]:
    made = {}
    with stack.admin() as admin:
        for name in REWARDS:
            r = admin.post(
                "/admin/v1/runs", json={"name": name, "model": "smollm2", "config": CONFIG}
            )
            assert r.status_code == 201, r.text
            info = r.json()
            made[name] = LoraRun(info, info["base_url"].removesuffix("/v1"), database)
    return made


def _info(stack, run: LoraRun) -> dict:
    with stack.admin() as admin:
        return admin.get(f"/admin/v1/runs/{run.id}").json()


def _train_one_step(stack, run: LoraRun, reward: Callable[[str, int], float]) -> int:
    """Waves of the run's own reward until its version moves by one; the new version."""
    target = _info(stack, run)["current_version"] + 1
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rewards = run.wave(reward)
        if len(set(rewards)) == 1:
            continue  # a zero-variance group is skipped (zero_variance_groups: skip)
        while time.monotonic() < deadline:
            info = _info(stack, run)
            if info["served_version"] == target:
                return target
            time.sleep(0.3)
    with stack.admin() as admin:
        steps = admin.get(f"/admin/v1/runs/{run.id}/steps").json()
    raise AssertionError(f"{run.info['name']} never served v{target}; steps: {steps}")


# --- each run trains on its own rewards; nobody else moves ----------------------------------


def test_each_run_trains_on_its_own_rewards_and_moves_only_itself(stack, runs) -> None:
    base = {name: run.greedy() for name, run in runs.items()}
    assert {tuple(tokens) for tokens, _ in base.values()} == {tuple(base["favour"][0])}
    assert {v for _, v in base.values()} == {0}
    for name, run in runs.items():
        others = {n: r.greedy() for n, r in runs.items() if n != name}
        for _ in range(MAX_STEPS if name == "favour" else 1):
            version = _train_one_step(stack, run, REWARDS[name])
            for other, before in others.items():  # token for token, at the same version
                assert runs[other].greedy() == before, f"{other} moved when {name} trained"
            if run.greedy()[0] != base[name][0]:
                break
        assert run.greedy()[1] == version
    trained, version = runs["favour"].greedy()
    print(f"favour: greedy {base['favour'][0]} at v0 -> {trained} at v{version}")
    assert trained != base["favour"][0], f"no change in {version} steps"


def test_a_version_is_an_adapter_a_few_mb(stack, runs, database: str, smollm2_cache: Path) -> None:
    import psycopg

    run = runs["favour"]
    with psycopg.connect(database) as conn:
        ((path,),) = conn.execute(
            "SELECT checkpoint_path FROM policy_versions WHERE run_id = %s AND version = %s",
            (run.id, _info(stack, run)["current_version"]),
        ).fetchall()
    ckpt = Path(path)
    adapter = (ckpt / "adapter_model.safetensors").stat().st_size
    total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    model_dir = next((smollm2_cache / "models").glob("smollm2*"))
    model = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(
        f"checkpoint {ckpt.name}: adapter {adapter / 1e6:.1f} MB, directory {total / 1e6:.1f} MB,"
        f" model {model / 1e6:.0f} MB"
    )
    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == CONFIG["lora_rank"]
    assert total < model / 20


def test_the_merged_export_answers_like_the_served_adapter(stack, runs, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run = runs["favour"]
    version = _info(stack, run)["current_version"]
    out = tmp_path / "merged"
    env = {"RLGATE_URL": stack.url, "RLGATE_ADMIN_KEY": stack.admin_key, "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "export", "--run", run.id, "--merged", "--out", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert not list(out.glob("adapter_*")), "a plain model, not an adapter"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    served = run.ask(0.0, GREEDY_TOKENS, "/groups/merged/episodes/greedy")
    assert served["version"] == version
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([served["prompt"]]),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            eos_token_id=model.generation_config.eos_token_id,
        )
    assert gen[0, len(served["prompt"]) :].tolist() == served["output"]

    sampled = run.ask(1.0, SAMPLE_TOKENS, "/groups/merged/episodes/sampled")
    ids = sampled["prompt"] + sampled["output"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    start = len(sampled["prompt"]) - 1
    lps = torch.log_softmax(logits[start : start + len(sampled["output"])], dim=-1)
    expected = lps[torch.arange(len(sampled["output"])), torch.tensor(sampled["output"])]
    gap = float((expected - torch.tensor(sampled["logprobs"])).abs().max())
    assert gap < 1e-3, gap


@pytest.mark.parametrize(
    ("config", "param"),
    [
        ({"lora_rank": 0}, "config.lora_rank"),
        ({"lora_alpha": 16}, "config.lora_alpha"),
        ({"lora_rank": 8, "lora_dropout": 1.5}, "config.lora_dropout"),
        ({"lora_rank": 8, "lora_target_modules": ["q_proj", "qkv"]}, "config.lora_target_modules"),
        ({"lora_rank": 8, "engine": "megatron"}, "config.lora_rank"),
    ],
)
def test_bad_lora_options_are_a_400_naming_the_option(stack, config: dict, param: str) -> None:
    with stack.admin() as admin:
        r = admin.post("/admin/v1/runs", json={"name": "bad", "model": "smollm2", "config": config})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_lora_run_rolls_back_to_a_trained_version_only(stack, runs) -> None:
    run = runs["short"]
    with stack.admin() as admin:
        r = admin.post(f"/admin/v1/runs/{run.id}/versions/0/rollback")
    assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
    assert _info(stack, run)["current_version"] == 1  # nothing was written


def test_the_example_trains_one_of_three_new_runs(stack, runs) -> None:
    """examples/lora_runs.py on the same gateway: three more runs on the same base model."""
    example = Path(__file__).resolve().parents[2] / "examples" / "lora_runs.py"
    env = {
        "RLGATE_URL": stack.url,
        "RLGATE_ADMIN_KEY": stack.admin_key,
        "RLGATE_LORA_STEPS": "1",
        "PATH": "",
    }
    done = subprocess.run(
        [sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr
    assert "tenant-a now serves version 1" in done.stdout
    assert "only tenant-a moved" in done.stdout


def test_pause_answers_429_to_one_run_and_stop_unloads_only_its_adapter(stack, runs) -> None:
    before = {name: run.greedy() for name, run in runs.items()}
    with stack.admin() as admin:
        assert admin.post(f"/admin/v1/runs/{runs['short'].id}/pause").status_code == 200
    with pytest.raises(openai.RateLimitError):
        runs["short"].greedy()
    assert runs["favour"].greedy() == before["favour"]
    assert runs["two"].greedy() == before["two"]
    with stack.admin() as admin:
        assert admin.post(f"/admin/v1/runs/{runs['short'].id}/resume").status_code == 200
        assert admin.post(f"/admin/v1/runs/{runs['two'].id}/stop").status_code == 200
    assert runs["short"].greedy() == before["short"]
    assert _info(stack, runs["two"])["served_version"] is None  # its adapter is gone
    assert runs["favour"].greedy() == before["favour"]
    assert runs["short"].greedy() == before["short"]
