"""A two-role agent for the policies tests: a planner answers, a coder continues its episode.

Used by tests/integration/test_policies.py (local backend); the same team runs on
any backend. Each episode calls both policies of one run: the planner answers
PLAN, then the coder answers the planner's conversation plus CODE, so its prompt
carries the planner's sampled ids (the splice across policies).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai

from tests.integration.lora_agents import CONFIG as LORA_CONFIG

PLAN = "Pick a number from 1 to 5. Answer with the number only."
CODE = "Now pick a different number from 1 to 5. Answer with the number only."
POLICIES = ("planner", "coder")
CONFIG = LORA_CONFIG | {"policies": {name: {} for name in POLICIES}}
SAMPLE_TOKENS = 8
GREEDY_TOKENS = 10
# A probe's fixed conversation per role: a role's greedy answer moves only with its weights.
PROBES = {
    "planner": [{"role": "user", "content": PLAN}],
    "coder": [
        {"role": "user", "content": PLAN},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": CODE},
    ],
}

# (policy, answer text, sampled tokens) -> reward; for an episode reward ("episode", the
# episode's place in its group, both answers' tokens)
Reward = Callable[[str, str, int], float]


@dataclass(frozen=True)
class Greedy:
    text: str
    tokens: tuple[int, ...]
    version: int


@dataclass
class Team:
    info: dict  # the created run (run_id, name, api_key, base_url)
    root: str
    admin: Callable[[], httpx.Client]
    db: str  # the store (PostgreSQL), read for the stored token ids
    waves: int = 0

    @property
    def name(self) -> str:
        return self.info["name"]

    def agent(self, path: str = "") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.root}{path}/v1", api_key=self.info["api_key"], max_retries=0
        )

    def policy_runs(self) -> dict[str, dict]:
        """Each policy's run, as the admin API shows it (versions current and served)."""
        with self.admin() as admin:
            runs = admin.get("/admin/v1/runs").json()
        return {r["policy"]: r for r in runs if r["parent_id"] == self.info["run_id"]}

    def versions(self) -> dict[str, int]:
        return {p: r["served_version"] or 0 for p, r in self.policy_runs().items()}

    def ask(self, policy: str, messages: list[dict], temperature: float, path: str):
        return self.agent(path).chat.completions.create(
            model=f"{self.name}/{policy}",
            messages=messages,
            max_tokens=GREEDY_TOKENS if temperature == 0 else SAMPLE_TOKENS,
            temperature=temperature,
        )

    def greedy(self, policy: str) -> Greedy:
        """The policy's greedy answer to its probe, its stored token ids and version."""
        import numpy as np
        import psycopg

        path = f"/groups/greedy/episodes/greedy-{policy}-{time.monotonic_ns()}"
        resp = self.ask(policy, PROBES[policy], 0.0, path)
        with psycopg.connect(self.db) as conn:
            ((output, version),) = conn.execute(
                "SELECT output_token_ids, policy_version FROM completions WHERE id = %s",
                (resp.id,),
            ).fetchall()
        assert version == resp.model_extra["policy_version"]
        ids = tuple(np.frombuffer(output, dtype="<i4").tolist())
        return Greedy(resp.choices[0].message.content or "", ids, version)

    def wave(self, reward: Reward, scope: str | None) -> list[float]:
        """One group of episodes, each calling the planner then the coder, rewarded with
        `reward`: for policy `scope` only, or (None) one episode reward of both answers."""
        g = self.waves
        self.waves += 1
        posts, rewards = [], []
        for e in range(CONFIG["group_size"]):
            episode = f"w{g}-{e}"
            path = f"/groups/g{g}/episodes/{episode}"
            plan = self.ask("planner", PROBES["planner"], 1.0, path)
            planned = plan.choices[0].message.content or ""
            history = [*PROBES["planner"], {"role": "assistant", "content": planned}]
            code = self.ask("coder", [*history, {"role": "user", "content": CODE}], 1.0, path)
            answers = {
                "planner": (planned, plan.usage.completion_tokens),
                "coder": (code.choices[0].message.content or "", code.usage.completion_tokens),
            }
            if scope is None:  # one reward for the episode, from both answers
                r = reward("episode", f"{e}", sum(n for _, n in answers.values()))
                posts.append({"episode_id": episode, "reward": r})
            else:  # + a tie-break by place: once every sample leaves the base answer (while
                # the greedy one may not yet), a group still differs, and a step still trains
                r = reward(scope, *answers[scope]) + 0.01 * e
                posts.append({"episode_id": episode, "policy": scope, "reward": r})
            rewards.append(r)
        self.agent().post("/rewards", body=posts, cast_to=object)
        return rewards

    def train(self, reward: Reward, scope: str | None, timeout_s: float = 600) -> dict[str, int]:
        """Waves until every policy `scope` names (None: both) serves one more version;
        the versions then."""
        before = self.versions()
        moving = POLICIES if scope is None else (scope,)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(set(self.wave(reward, scope))) == 1:
                continue  # a zero-variance group is skipped (zero_variance_groups: skip)
            while time.monotonic() < deadline:
                now = self.versions()
                if all(now[p] > before[p] for p in moving):
                    return now
                time.sleep(0.3)
        raise AssertionError(f"{moving} never moved past {before}")


MAX_STEPS = 12


def away_from(base: dict[str, str]):
    """Reward 1 for an answer that does not start like the policy's base greedy answer."""

    def reward(policy: str, text: str, n_tokens: int) -> float:
        return 0.0 if text.strip()[:1] == base[policy].strip()[:1] else 1.0

    return reward


def train_until_moved(team: Team, policy: str, reward, base: dict[str, Greedy]) -> None:
    """Scoped steps for `policy` until its greedy answer leaves `base`; after each step the
    other policy's greedy answer (token for token) and version are checked unchanged."""
    other = next(p for p in POLICIES if p != policy)
    held = team.greedy(other)
    for _ in range(MAX_STEPS):
        versions = team.train(reward, policy)
        assert team.greedy(other) == held, f"{other} moved when {policy} trained"
        assert versions[other] == held.version
        now = team.greedy(policy)
        assert now.version == versions[policy]
        if now.tokens != base[policy].tokens:
            print(f"{policy}: {base[policy].text!r} at v0 -> {now.text!r} at v{now.version}")
            return
    raise AssertionError(f"{policy}'s greedy answer did not move in {MAX_STEPS} steps")


def scoped_then_whole(team: Team) -> None:
    """The policies tests' scenario (tests/integration/test_policies.py's docstring): planner
    rewards move the planner only, coder rewards the coder only, episode rewards both."""
    base = {p: team.greedy(p) for p in POLICIES}
    assert {p: g.version for p, g in base.items()} == {p: 0 for p in POLICIES}
    reward = away_from({p: g.text for p, g in base.items()})
    train_until_moved(team, "planner", reward, base)
    train_until_moved(team, "coder", reward, base)
    before = team.versions()
    # By the episode's place in its group: trained answers may all score alike on the rule
    # above, and a zero-variance group teaches nothing; this one always differs.
    after = team.train(lambda _policy, place, _tokens: float(place), None)
    assert all(after[p] > before[p] for p in POLICIES), (before, after)


def create_team(stack, db: str, **body: object) -> Team:
    """A run named "team" with the policies of CONFIG on `stack` (`body`: more of the
    create request, e.g. a backend and its replicas)."""
    with stack.admin() as admin:
        r = admin.post(
            "/admin/v1/runs", json={"name": "team", "model": "smollm2", "config": CONFIG, **body}
        )
    assert r.status_code == 201, r.text
    created = r.json()
    return Team(created, created["base_url"].removesuffix("/v1"), stack.admin, db)
