"""`rlgate bench learn`'s task: the held-out split, the training order, the score, the wiring."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from rlgate import learn_task
from rlgate.learn_task import Problem, fields, messages, score, split, train_order

ROOT = Path(__file__).resolve().parents[2]


def test_the_splits_are_fixed_disjoint_and_cover_every_problem():
    train, heldout = split("train"), split("heldout")
    assert len(heldout) == learn_task.HELDOUT_SIZE == 20
    assert len(train) == 61
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(learn_task.all_problems())
    assert split("heldout") == heldout  # the same problems every call, run and seed
    with pytest.raises(ValueError, match="train or heldout"):
        split("test")


def test_the_training_order_is_a_seeded_permutation_of_the_train_split():
    assert sorted(train_order(0), key=str) == sorted(split("train"), key=str)
    assert train_order(0) == train_order(0)
    assert train_order(0) != train_order(1)
    assert not set(train_order(3)) & set(split("heldout"))


@pytest.mark.parametrize(
    "reply,expected",
    [
        ("8", 1.0),
        (" 8.\n", 1.0),
        ("8!", 1.0),
        ("3 + 5 = 8", 0.3 + 0.4 * 5 / 9),
        ("The answer is 8.", 0.3 + 0.4 * 6 / 9),
        ("Eight is the sum, and as a number 8 is what you get here", 0.3),
        ("3 + 5 = 9", 0.0),
        ("18", 0.0),  # a number, not a substring, must match
        ("-8", 0.0),
        ("", 0.0),
        ("eight", 0.0),
    ],
)
def test_score(reply, expected):
    assert score(Problem(3, 5), reply) == pytest.approx(expected)


def test_score_is_deterministic_and_bounded():
    for p in learn_task.all_problems():
        for reply in (str(p.answer), f"{p.a} + {p.b} = {p.answer}", "no idea", f"{p.answer + 1}"):
            r = score(p, reply)
            assert 0.0 <= r <= 1.0
            assert r == score(p, reply)


def test_problem_round_trips_through_its_fields_and_sends_one_user_message():
    p = Problem(4, 7)
    assert Problem(**fields(p)) == p
    assert messages(p) == [{"role": "user", "content": p.prompt}]
    assert p.answer == 11


def test_the_task_imports_only_the_standard_library_and_the_demo_task():
    """TRL's venv imports it from rlgate's folder alone: nothing else of rlgate, no dependency."""
    for name in ("learn_task.py", "demo_task.py"):
        tree = ast.parse((ROOT / "rlgate" / name).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        third_party = {m for m in names if m.split(".")[0] not in sys.stdlib_module_names}
        assert third_party <= {"__future__", "rlgate.demo_task"}


def test_the_trl_script_loads_the_task_by_path_and_scores_the_same():
    from rlgate.bench.learn_trl import load_task

    task = load_task(str(ROOT / "rlgate" / "learn_task.py"))
    p = split("heldout")[0]
    for reply in (str(p.answer), f"{p.a} + {p.b} = {p.answer}", "no"):
        assert task.score(task.Problem(**fields(p)), reply) == score(p, reply)
    assert [fields(q) for q in task.train_order(5)] == [fields(q) for q in train_order(5)]


def test_the_rlgate_run_overrides_only_the_shared_hyperparameters():
    from rlgate.bench.learn import LearnConfig
    from rlgate.bench.learn_stack import run_config
    from trainer.config import RunConfig

    cfg = LearnConfig(learning_rate=3e-5, clip=0.25, seed=7)
    body = run_config(cfg)
    shared = {"group_size", "groups_per_step", "learning_rate", "clip_eps_low", "clip_eps_high"}
    assert set(body) <= shared | {"kl_coef", "micro_batch_size", "seed"}
    run = RunConfig(**body)
    assert (run.group_size, run.groups_per_step) == (4, 4)
    assert (run.learning_rate, run.clip_eps_low, run.clip_eps_high, run.seed) == (
        3e-5,
        0.25,
        0.25,
        7,
    )
    assert run.max_staleness == RunConfig().max_staleness
    assert run.max_pending_episodes == RunConfig().max_pending_episodes


@pytest.mark.parametrize("budget", [0, 8, 100])
def test_the_budget_is_whole_steps(budget):
    from rlgate.bench.learn import LearnConfig

    with pytest.raises(ValueError, match="--budget"):
        LearnConfig(budget=budget)


def test_trained_fraction_counts_only_groups_with_reward_variance():
    from rlgate.bench.learn_stack import Sample, trained_figures

    samples = [
        Sample(float(i), r, g, f"{g}-{i}")
        for g, rs in (("a", [0, 1]), ("b", [0, 0]))
        for i, r in enumerate(rs)
    ]
    side = {
        "samples": samples,
        "episodes": [
            {"episode_id": "a-0", "group_id": "a", "status": "trained"},
            {"episode_id": "a-1", "group_id": "a", "status": "dropped"},
            {"episode_id": "b-0", "group_id": "b", "status": "rewarded"},
        ],
        "steps": [{"step": 0, "n_episodes": 1}],
        "points": [{"step": 0, "values": {"staleness_mean": 1.0, "clip_frac": 0.5}}],
        "counters": {"dropped": {"dropped_stale_episodes": 1}},
    }
    figures = trained_figures(side, group_size=2)
    assert figures["trained_fraction"] == 0.5  # a-0 of {a-0, a-1}; group b had no variance
    assert figures["zero_variance_completions"] == 2
    assert (figures["staleness_mean"], figures["clip_frac"], figures["steps"]) == (1.0, 0.5, 1)


def test_the_cli_registers_bench_learn():
    from rlgate.cli import build_parser

    args = build_parser().parse_args(["bench", "learn", "--budget", "64", "--seeds", "0,1"])
    assert (args.budget, args.seeds, args.model) == (64, "0,1", "smollm2")
    assert args.func.__module__ == "rlgate.bench.learn"


def test_trl_side_script_is_the_module_beside_the_bench() -> None:
    """TRL's side runs a file by path in another venv: a renamed module must not break it."""
    from rlgate.bench import learn, learn_trl

    assert learn.trl_script() == Path(learn_trl.__file__)
    assert learn.trl_script().is_file()
