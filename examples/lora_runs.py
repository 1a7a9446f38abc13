"""Three LoRA runs on one base model in one gateway: train one, and only its answer moves.

Run against a gateway (`rlgate up`), with its admin key:

    RLGATE_URL=http://127.0.0.1:8000 RLGATE_ADMIN_KEY=... python examples/lora_runs.py

RLGATE_LORA_MODEL picks the base model (default smollm2), RLGATE_LORA_STEPS the
number of train steps of tenant-a (default 4). See docs/lora.md.
"""

import os
import time

import httpx
import openai

url = os.environ.get("RLGATE_URL", "http://127.0.0.1:8000")
admin = httpx.Client(
    base_url=url,
    headers={
        "Authorization": f"Bearer {os.environ.get('RLGATE_ADMIN_KEY', 'rlgate-dev-admin-key')}"
    },
    timeout=600,
)
model = os.environ.get("RLGATE_LORA_MODEL", "smollm2")
steps = int(os.environ.get("RLGATE_LORA_STEPS", "4"))
question = [{"role": "user", "content": "Pick a number from 1 to 5. Answer with the number only."}]
config = {"lora_rank": 8, "group_size": 4, "groups_per_step": 1, "micro_batch_size": 4,
          "learning_rate": 3e-3, "zero_variance_groups": "skip"}  # fmt: skip

# 1. Three runs, one base model: the gateway loads it once and one adapter per run.
runs = {}
for name in ("tenant-a", "tenant-b", "tenant-c"):
    r = admin.post("/admin/v1/runs", json={"name": name, "model": model, "config": config})
    runs[name] = r.raise_for_status().json()


def answer(name: str, path: str, temperature: float = 0.0) -> tuple[str, str]:
    """The run's reply (text, completion id) in the episode that `path` names."""
    run = runs[name]
    root = run["base_url"].removesuffix("/v1")
    agent = openai.OpenAI(base_url=f"{root}{path}/v1", api_key=run["api_key"])
    reply = agent.chat.completions.create(
        model=name, messages=question, max_tokens=8, temperature=temperature
    )
    return reply.choices[0].message.content or "", reply.id


def served(run: dict) -> int:
    return admin.get(f"/admin/v1/runs/{run['run_id']}").json()["served_version"] or 0


before = {name: answer(name, f"/episodes/{name}-before")[0] for name in runs}
print("before:", before)

# 2. Train tenant-a only: one group of 4 answers per step, rewarding those not starting "1".
a = runs["tenant-a"]
headers = {"Authorization": f"Bearer {a['api_key']}"}
for step in range(steps):
    version, wave = served(a), 0
    while served(a) == version:
        group = f"s{step}-w{wave}"
        for e in range(config["group_size"]):
            text, cid = answer("tenant-a", f"/groups/{group}/episodes/{group}-{e}", 1.0)
            reward = 0.0 if text.strip().startswith("1") else 1.0
            body = {"completion_id": cid, "reward": reward}
            httpx.post(a["base_url"] + "/rewards", json=body, headers=headers).raise_for_status()
        wave += 1  # all four scored the same (a skipped group): another wave
        for _ in range(120):  # a step takes a few seconds on CPU
            if served(a) > version:
                break
            time.sleep(0.5)
    print(f"tenant-a now serves version {served(a)}")

# 3. Only tenant-a's answer moved.
after = {name: answer(name, f"/episodes/{name}-after")[0] for name in runs}
print("after: ", after)
for name in ("tenant-b", "tenant-c"):
    assert after[name] == before[name], f"{name} moved"
print("only tenant-a moved:", repr(before["tenant-a"]), "->", repr(after["tenant-a"]))
