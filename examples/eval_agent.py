"""Held-out reward per version: train through the run's base_url, evaluate through `/eval`.

The agent answers single-digit additions. Most problems are for training:
each goes to a group of agents on the run's `base_url`, and their rewards
train the policy. A few are held out: every `--eval-every` versions they go
through the same run's `/eval` base_url instead, greedily, and their rewards
are posted the same way. The gateway serves and scores evaluation calls but
never trains on them nor counts them against admission, so the held-out
reward it reports per version (`GET /admin/v1/runs/{run_id}/evals`) measures
what the policy learned on problems it never saw in training.

Run against a gateway with a worker (`rlgate up`) and a run
(`rlgate runs create ... --json`); the admin key reads the figures:

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
    RLGATE_ADMIN_KEY=... python examples/eval_agent.py --versions 4 --eval-every 2
"""

import argparse
import os
import random
import sys
import uuid

import httpx
import openai

base_url = os.environ["RLGATE_BASE_URL"]  # the run's base_url, ending in /v1
key = os.environ["RLGATE_API_KEY"]
model = os.environ["RLGATE_MODEL"]
root = base_url.removesuffix("/v1")  # the gateway: /eval/... and /admin/... hang off it
admin = httpx.Client(
    base_url=root, headers={"Authorization": f"Bearer {os.environ['RLGATE_ADMIN_KEY']}"}
)
agent_http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"})

problems = [(a, b) for a in range(1, 10) for b in range(1, 10)]
random.Random(0).shuffle(problems)
HELDOUT, TRAIN = problems[:8], problems[8:]  # the held-out sums never reach training


def ask(client: openai.OpenAI, a: int, b: int, **sampling) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
        max_tokens=8,
        **sampling,
    )
    return reply.choices[0].message.content or ""


def score(a: int, b: int, reply: str) -> float:
    return 1.0 if reply.strip().rstrip(".") == str(a + b) else 0.0


def reward(episode: str, value: float) -> None:
    agent_http.post("/rewards", json={"episode_id": episode, "reward": value}).raise_for_status()


def train_group(a: int, b: int, size: int) -> None:
    """One GRPO group: `size` attempts at one training problem, each its own episode."""
    group = "train-" + uuid.uuid4().hex[:8]
    for i in range(size):
        episode = f"{group}-{i}"
        client = openai.OpenAI(base_url=f"{root}/groups/{group}/episodes/{episode}/v1", api_key=key)
        reward(episode, score(a, b, ask(client, a, b, temperature=1.0)))


def evaluate() -> None:
    """The held-out set once through `/eval`, greedily; each problem an evaluation episode."""
    tag = uuid.uuid4().hex[:8]
    for i, (a, b) in enumerate(HELDOUT):
        episode = f"eval-{tag}-{i}"
        client = openai.OpenAI(base_url=f"{root}/eval/episodes/{episode}/v1", api_key=key)
        reward(episode, score(a, b, ask(client, a, b, temperature=0.0)))


def report(run_id: str) -> None:
    """The gateway's figures: one row per version that served a whole evaluation episode."""
    figures = admin.get(f"/admin/v1/runs/{run_id}/evals").raise_for_status().json()
    for row in figures["data"]:
        spread = f" ± {row['stderr']:.3f}" if row["stderr"] is not None else ""
        print(
            f"held-out v{row['version']}: reward {row['mean_reward']:.3f}{spread} "
            f"over {row['episodes']} episodes"
        )
    if figures["spanning"]:  # an episode that a hot swap cut between two versions
        print(f"held-out, spanning a swap: {figures['spanning']['episodes']} episodes")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=4, help="train until this version is served")
    p.add_argument("--eval-every", type=int, default=2, help="evaluate every N versions")
    p.add_argument("--group-size", type=int, default=4, help="attempts per training problem")
    p.add_argument("--max-groups", type=int, default=500, help="give up after this many groups")
    args = p.parse_args()

    run_id = agent_http.get("/runs/self").raise_for_status().json()["run_id"]

    def served() -> int:  # the version the backend serves (null until its first call)
        info = admin.get(f"/admin/v1/runs/{run_id}").raise_for_status().json()
        return info["served_version"] or 0

    version = evaluated = served()
    evaluate()
    print(f"evaluated v{version}")
    groups = 0
    while version < args.versions:
        if groups == args.max_groups:
            print(f"version {args.versions} was not served after {groups} groups")
            return 1
        train_group(*TRAIN[groups % len(TRAIN)], args.group_size)
        groups += 1
        version = served()
        if version - evaluated >= args.eval_every:  # N versions since the last evaluation
            evaluate()
            evaluated = version
            print(f"evaluated v{version}")
    report(run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
