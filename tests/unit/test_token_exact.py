"""Token-exact multi-turn: splicing sampled ids back in, detecting template drift, and
assembling training sequences that are concatenations of exactly the sampled ids."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from inference.chat_template import ChatTemplate
from trainer.sequences import Turn, assemble

# Like Qwen3's: earlier assistant turns are rendered without their <think> block.
STRIP_THINKING = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def thinking(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    d = tmp_path_factory.mktemp("thinking-model")
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, d / f.name)
    (d / "chat_template.jinja").write_text(STRIP_THINKING)
    return ChatTemplate(d)


def _sample(template: ChatTemplate, text: str) -> list[int]:
    """Ids as a model would sample them: the text, then the stop token."""
    return [*template.encode(text), template.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _play(template: ChatTemplate, answers: list[str]) -> tuple[list[Turn], list[bool]]:
    """A conversation where turn k's prompt continues turn k-1, as the gateway builds it."""
    messages = [{"role": "user", "content": "what is 1 + 2?"}]
    turns: list[Turn] = []
    spliced_flags: list[bool] = []
    prompt = template.render(messages)
    spliced = False
    for k, answer in enumerate(answers):
        out = _sample(template, answer)
        turns.append(
            Turn(
                f"t{k}",
                f"t{k - 1}" if k else None,
                prompt,
                out,
                [-0.5] * len(out),
                1.0,
                0,
                spliced,
                f"h{k}",
                k,
            )
        )
        spliced_flags.append(spliced)
        content = template.decode(out)
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"and then {k}?"},
        ]
        prompt, spliced = template.continue_from(prompt + out, messages)
    return turns, spliced_flags


ANSWERS = ["the answer is three", "<think>one plus two</think> three", "yes, three"]


def test_plain_template_splices_every_turn(plain: ChatTemplate) -> None:
    turns, flags = _play(plain, ANSWERS)
    assert flags == [False, True, True]  # turn 0 has no parent; every later turn splices
    for parent, child in itertools.pairwise(turns):
        assert child.prompt_token_ids[
            : len(parent.prompt_token_ids) + len(parent.output_token_ids)
        ] == (parent.prompt_token_ids + parent.output_token_ids)


def test_thinking_template_drifts_exactly_after_the_thinking_turn(thinking: ChatTemplate) -> None:
    turns, flags = _play(thinking, ANSWERS)
    # turn 1 continues turn 0 (no <think> in it); turn 2 follows the <think> answer of turn 1,
    # which the template strips from history: the model never saw that text, so no splice.
    assert flags == [False, True, False]
    # the drifted prompt is the template's own rendering, without the thinking
    assert "one plus two" not in thinking.tokenizer.decode(turns[2].prompt_token_ids)


@pytest.mark.parametrize("which", ["plain", "thinking"])
def test_assembled_sequences_are_concatenations_of_sampled_ids(which: str, request) -> None:
    template = request.getfixturevalue(which)
    turns, flags = _play(template, ANSWERS)
    samples = assemble(turns, {t.id: 1.0 for t in turns})
    # one sequence per run of spliced turns
    assert len(samples) == flags.count(False)
    trained = []
    for s in samples:
        masked = [tok for tok, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
        trained.append(masked)
    # every sampled id is trained exactly once, in order, and nothing else is
    assert [tok for seq in trained for tok in seq] == [
        tok for t in turns for tok in t.output_token_ids
    ]
    # each sequence is literally the ids the model saw and sampled in its last turn
    leaves = [t for t, nxt in zip(turns, [*flags[1:], False], strict=True) if not nxt]
    assert [s.input_ids for s in samples] == [
        t.prompt_token_ids + t.output_token_ids for t in leaves
    ]
    for s in samples:
        assert all(lp == -0.5 for lp, m in zip(s.old_logprobs, s.loss_mask, strict=True) if m)
