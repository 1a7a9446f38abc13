"""Synthetic store rows for the benches and the tests: completions, and a run seeded with steps.

`seed_store` fills a store the way a run's finished, rewarded groups do (one
prompt per group, mixed rewards so every group trains), without a gateway;
`synthetic_row` is one captured completion of plausible size.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.store.models import Completion
    from trainer.config import RunConfig

RUN_ID = "seeded"


@dataclass(frozen=True)
class StepShape:
    """What one step trains: `groups` x `group_size` completions of these lengths."""

    groups: int = 4
    group_size: int = 4
    prompt_len: tuple[int, int] = (40, 80)  # a short chat-templated task
    output_len: tuple[int, int] = (8, 16)  # max_tokens 16, some stop early

    @property
    def completions(self) -> int:
        return self.groups * self.group_size


def seed_store(
    url: str,
    model_dir: Path,
    cfg: RunConfig,
    steps: int,
    shape: StepShape,
    run_id: str = RUN_ID,
    *,
    seed: int = 0,
) -> None:
    """A run at version 0 with `steps` queued train steps, each with the same token content.

    Runs seeded with the same `seed` train the same tokens, whatever their `run_id`.
    """
    from sqlalchemy.orm import sessionmaker

    from core.store.db import make_sync_engine
    from core.store.migrate import upgrade
    from core.store.models import Completion, Episode, PolicyVersion, Reward, Run, TrainStep
    from core.store.status import EpisodeStatus, StepStatus

    upgrade(url)
    vocab = _vocab_size(model_dir)
    engine = make_sync_engine(url)
    now = datetime.now(UTC)
    with sessionmaker(engine).begin() as s:
        s.add(
            Run(
                id=run_id,
                name=run_id,
                model=str(model_dir),
                model_path=str(model_dir),
                config=cfg.model_dump(mode="json"),
            )
        )
        s.flush()  # no ORM relationships: the run row must exist before rows that refer to it
        s.add(PolicyVersion(run_id=run_id, version=0, checkpoint_path=str(model_dir)))
        for step in range(steps):
            rng = random.Random(seed)  # every step trains the same tokens
            s.add(
                TrainStep(
                    run_id=run_id,
                    step=step,
                    status=StepStatus.QUEUED,
                    n_episodes=shape.completions,
                    n_groups=shape.groups,
                )
            )
            s.flush()
            for g in range(shape.groups):
                # a GRPO group: one prompt, group_size answers to it
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(*shape.prompt_len))]
                for e in range(shape.group_size):
                    episode = f"{run_id}-s{step}-g{g}-e{e}"
                    reward = float(rng.random() < 0.5) if e else float(g % 2)  # mixed groups
                    s.add(
                        Episode(
                            run_id=run_id,
                            id=episode,
                            group_id=f"{run_id}-s{step}-g{g}",
                            status=EpisodeStatus.QUEUED,
                            reward=reward,
                            train_step=step,
                            rewarded_at=now,
                        )
                    )
                    s.flush()  # the completion refers to its episode
                    n_out = rng.randint(*shape.output_len)
                    s.add(
                        Completion(
                            id=f"c-{episode}",
                            run_id=run_id,
                            episode_id=episode,
                            messages=[],
                            prompt_token_ids=prompt,
                            output_token_ids=[rng.randrange(vocab) for _ in range(n_out)],
                            output_logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n_out)],
                            content="",
                            finish_reason="length",
                            temperature=1.0,
                            policy_version=step,
                        )
                    )
                    s.add(Reward(run_id=run_id, episode_id=episode, value=reward))
    engine.dispose()


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def synthetic_row(
    run_id: str, episode_id: str, parent_id: str | None, rng: random.Random
) -> Completion:
    """A completion of 100-400 prompt and 16-128 output tokens, hashed for prefix linking."""
    from core.store.models import Completion
    from gateway.agent.episodes import conversation_hash

    n_prompt, n_out = rng.randint(100, 400), rng.randint(16, 128)
    messages = [{"role": "user", "content": f"task {rng.random()}"}]
    return Completion(
        id="chatcmpl-" + uuid.uuid4().hex,
        run_id=run_id,
        episode_id=episode_id,
        parent_id=parent_id,
        messages=messages,
        prompt_token_ids=[rng.randrange(50000) for _ in range(n_prompt)],
        output_token_ids=[rng.randrange(50000) for _ in range(n_out)],
        output_logprobs=[-rng.uniform(0.0, 8.0) for _ in range(n_out)],
        content="x" * (4 * n_out),
        finish_reason="stop",
        temperature=1.0,
        policy_version=0,
        conv_hash=conversation_hash([*messages, {"role": "assistant", "content": str(rng)}]),
        prompt_hash=conversation_hash(messages),
        link="new" if parent_id is None else "prefix",
    )
