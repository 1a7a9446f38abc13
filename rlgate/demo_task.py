"""The demo's task: single-digit addition, scored by a programmatic reward.

Why this task: it is verifiable by a one-line check, SmolLM2-135M starts out
doing it poorly (sampled at temperature 0.7 it never replies with the bare
number, writes "3 + 5 = 8" or long, wandering explanations, and often gets
the sum wrong: mean reward about 0.3), yet about half of the samples contain
the right sum, so GRPO groups have reward variance to learn from on the
first step. Partial credit rewards a correct sum inside a longer
answer (more for a shorter one); full credit needs the bare number.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_NUMBER = re.compile(r"-?\d+")


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


def make_problem(rng: random.Random) -> Problem:
    return Problem(rng.randint(1, 9), rng.randint(1, 9))


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
