"""The demo's task: single-digit addition, scored by a programmatic reward.

Why this task: it is verifiable by a one-line check, SmolLM2-135M starts out
doing it poorly (sampled at temperature 0.7 it never replies with the bare
number, writes "3 + 5 = 8" or long, wandering explanations, and often gets
the sum wrong: mean reward about 0.3), yet about half of the samples contain
the right sum, so GRPO groups have reward variance to learn from on the
first step. Partial credit rewards a correct sum inside a longer
answer (more for a shorter one); full credit needs the bare number.

A fixed, seeded choice of `HELDOUT_SIZE` of the 81 problems is held out:
training waves never draw them, and the demo's evaluation sends only them,
so its held-out reward measures sums the policy never trained on. The set is
small because the demo evaluates every few versions and each evaluation
should cost a few seconds of the demo's wall time.

This module imports only the standard library: `rlgate/learn_task.py`, and
through it TRL's side of `rlgate bench learn`, imports `Problem` from here.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_NUMBER = re.compile(r"-?\d+")
HELDOUT_SIZE = 8
HELDOUT_SEED = 4207  # fixed: the held-out problems are the same for every run and seed


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a} + {self.b}? Reply with only the number."

    @property
    def answer(self) -> int:
        return self.a + self.b


def heldout_problems() -> list[Problem]:
    """The held-out set, in a fixed order: never drawn for training, only evaluated."""
    every = [Problem(a, b) for a in range(1, 10) for b in range(1, 10)]
    return random.Random(HELDOUT_SEED).sample(every, HELDOUT_SIZE)


_HELDOUT = frozenset(heldout_problems())


def make_problem(rng: random.Random) -> Problem:
    """A training problem: `a` and `b` from 1 to 9, never one of the held-out set."""
    while True:
        problem = Problem(rng.randint(1, 9), rng.randint(1, 9))
        if problem not in _HELDOUT:
            return problem


def score(problem: Problem, reply: str) -> float:
    """1.0 for exactly the sum; partial credit for a reply that contains it, more if shorter.

    A reply containing the sum scores 0.5 plus up to 0.3 for brevity
    (0.3 at one word, falling linearly to 0 at 16 words or more). The
    graded credit keeps rewards within a group apart, so GRPO groups rarely
    have zero variance once the model has learned to state the sum.
    """
    text = reply.strip().rstrip(".!").strip()
    if text == str(problem.answer):
        return 1.0
    numbers = [int(n) for n in _NUMBER.findall(reply)]
    if problem.answer not in numbers:
        return 0.0
    words = len(reply.split())
    return 0.5 + 0.3 * max(0.0, (16 - words) / 15)
