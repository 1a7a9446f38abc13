"""The task of `rlgate bench learn`: single-digit addition with a held-out split, scored exactly.

Why this task: the check is one line and deterministic, so both sides of the
benchmark (rlgate's worker and TRL's `GRPOTrainer`) are scored by the same
function, and nothing but the policy decides the reward. SmolLM2-135M-Instruct
at temperature 1.0 and 16 new tokens starts far below the ceiling: it almost
never replies with the bare number (it writes "3 + 5 = 8", "The answer is 8,
which..." or wanders off), and only about a quarter of its replies contain
the right sum, so its mean reward starts near 0.1 against a ceiling of 1.0.
Yet enough samples earn something that most GRPO groups of 4 have reward
variance from the first step, and what GRPO learns first (answer shortly,
state the sum) carries over to sums it never trained on. That is what the
held-out split measures: 20 of the 81 problems (a fixed, seeded choice) are
never sampled for training, only for evaluation.

The word window of the partial credit (10 words) fits replies cut at 16
tokens, unlike the demo's task (`rlgate/demo_task.py`, 16 words at 24 tokens).

This module imports only the standard library and the demo's `Problem`:
`rlgate/bench/learn_trl.py`, which runs in TRL's own virtual environment,
imports it from rlgate's folder without the rest of rlgate, so both sides
score with this very code.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict
from typing import Any

from rlgate.demo_task import Problem

HELDOUT_SIZE = 20
SPLIT_SEED = 2126  # fixed: the held-out problems are the same for every run and seed
PARTIAL_BASE = 0.3  # a reply that contains the sum somewhere
PARTIAL_BREVITY = 0.4  # up to this much more for a short one
BREVITY_WORDS = 10  # at or past this many words, no brevity credit

_NUMBER = re.compile(r"-?\d+")


def messages(problem: Problem) -> list[dict[str, str]]:
    """The chat both sides send: one user message, under the model's own chat template."""
    return [{"role": "user", "content": problem.prompt}]


def fields(problem: Problem) -> dict[str, Any]:
    """JSON-able fields; `Problem(**fields)` rebuilds it (TRL passes them as columns)."""
    return asdict(problem)


def all_problems() -> list[Problem]:
    return [Problem(a, b) for a in range(1, 10) for b in range(1, 10)]


def split(name: str) -> list[Problem]:
    """`train` (61 problems) or `heldout` (20, never trained on), each in a fixed order."""
    problems = all_problems()
    random.Random(SPLIT_SEED).shuffle(problems)
    if name == "heldout":
        return problems[:HELDOUT_SIZE]
    if name == "train":
        return problems[HELDOUT_SIZE:]
    raise ValueError(f"unknown split {name!r}: train or heldout")


def train_order(seed: int) -> list[Problem]:
    """The training problems in one seeded order; callers cycle through it (epochs)."""
    problems = split("train")
    random.Random(seed).shuffle(problems)
    return problems


def score(problem: Problem, reply: str) -> float:
    """1.0 for exactly the sum; 0.3 to 0.7 for a reply that contains it; else 0.0.

    Exact: the reply is the sum once whitespace and a trailing `.` or `!`
    are stripped. Partial: the sum is among the reply's integers; 0.3 plus
    0.4 x (10 - words) / 9 for a reply of 1 to 10 words (so 0.3 at 10 words
    or more). The graded credit keeps rewards within a group apart, so fewer
    groups have zero variance once the model has learned to state the sum.
    """
    text = reply.strip().rstrip(".!").strip()
    if text == str(problem.answer):
        return 1.0
    if problem.answer not in (int(n) for n in _NUMBER.findall(reply)):
        return 0.0
    words = len(reply.split())
    brevity = max(0.0, (BREVITY_WORDS - words) / (BREVITY_WORDS - 1))
    return PARTIAL_BASE + PARTIAL_BREVITY * brevity
