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
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from core.settings import Settings
from tests.integration.lora_agents import (
    CONFIG,
    GREEDY_TOKENS,
    MAX_STEPS,
    REWARDS,
    SAMPLE_TOKENS,
    LoraRun,
    run_info,
    train_one_step,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(
    redis_url: str, module_postgres_url: str, smollm2_cache: Path, tmp_path_factory
) -> Iterator:
    from tests.integration.conftest import running_stack

    tmp = tmp_path_factory.mktemp("lora")
    settings = Settings(
        data_dir=tmp / "data",
        database_url=module_postgres_url,
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
def runs(stack, module_postgres_url: str) -> dict[str, LoraRun]:
    made = {}
    with stack.admin() as admin:
        for name in REWARDS:
            r = admin.post(
                "/admin/v1/runs", json={"name": name, "model": "smollm2", "config": CONFIG}
            )
            assert r.status_code == 201, r.text
            created = r.json()
            root = created["base_url"].removesuffix("/v1")
            made[name] = LoraRun(created, root, module_postgres_url)
    return made


# --- each run trains on its own rewards; nobody else moves ----------------------------------


def test_each_run_trains_on_its_own_rewards_and_moves_only_itself(stack, runs) -> None:
    base = {name: run.greedy() for name, run in runs.items()}
    assert {tuple(tokens) for tokens, _ in base.values()} == {tuple(base["favour"][0])}
    assert {v for _, v in base.values()} == {0}
    for name, run in runs.items():
        others = {n: r.greedy() for n, r in runs.items() if n != name}
        for _ in range(MAX_STEPS if name == "favour" else 1):
            version = train_one_step(stack, run, REWARDS[name])
            for other, before in others.items():  # token for token, at the same version
                assert runs[other].greedy() == before, f"{other} moved when {name} trained"
            if run.greedy()[0] != base[name][0]:
                break
        assert run.greedy()[1] == version
    trained, version = runs["favour"].greedy()
    print(f"favour: greedy {base['favour'][0]} at v0 -> {trained} at v{version}")
    assert trained != base["favour"][0], f"no change in {version} steps"


def test_a_version_is_an_adapter_a_few_mb(
    stack, runs, module_postgres_url: str, smollm2_cache: Path
) -> None:
    import psycopg

    run = runs["favour"]
    with psycopg.connect(module_postgres_url) as conn:
        ((path,),) = conn.execute(
            "SELECT checkpoint_path FROM policy_versions WHERE run_id = %s AND version = %s",
            (run.id, run_info(stack, run)["current_version"]),
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
    version = run_info(stack, run)["current_version"]
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
    assert run_info(stack, run)["current_version"] == 1  # nothing was written


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
    assert run_info(stack, runs["two"])["served_version"] is None  # its adapter is gone
    assert runs["favour"].greedy() == before["favour"]
    assert runs["short"].greedy() == before["short"]
