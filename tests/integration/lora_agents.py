"""LoRA-run agents for the integration tests: a shared prompt, reward rules, a run's client.

Used by tests/integration/test_lora_runs.py (local backend) and
tests/integration/test_vllm_lora.py (vLLM): the same agents and rewards on
either backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import openai

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


def run_info(stack, run: LoraRun) -> dict:
    """The run as the admin API shows it (versions current and served, status)."""
    with stack.admin() as admin:
        return admin.get(f"/admin/v1/runs/{run.id}").json()


def train_one_step(stack, run: LoraRun, reward: Callable[[str, int], float]) -> int:
    """Waves of the run's own reward until its version moves by one; the new version."""
    target = run_info(stack, run)["current_version"] + 1
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        rewards = run.wave(reward)
        if len(set(rewards)) == 1:
            continue  # a zero-variance group is skipped (zero_variance_groups: skip)
        while time.monotonic() < deadline:
            if run_info(stack, run)["served_version"] == target:
                return target
            time.sleep(0.3)
    with stack.admin() as admin:
        steps = admin.get(f"/admin/v1/runs/{run.id}/steps").json()
    raise AssertionError(f"{run.info['name']} never served v{target}; steps: {steps}")
