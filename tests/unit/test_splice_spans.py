"""Splicing by ids when sampled ids do not survive text (issue #22, item 2), on stored ids only.

No backend here: what a local or vLLM backend returned is a list of ids, and
the splice (`ChatTemplate.continue_from` with the answer spans from
`gateway.agent.episodes.sampled_stream`) works on those alone.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.agent.episodes import sampled_stream
from inference.chat_template import ChatTemplate
from tests.forced_tokens import byte_id
from tests.unit.test_token_exact import STRIP_THINKING


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def thinking(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    d = tmp_path_factory.mktemp("thinking-bytes")
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, d / f.name)
    (d / "chat_template.jinja").write_text(STRIP_THINKING)
    return ChatTemplate(d)


def answers(t: ChatTemplate) -> dict[str, list[int]]:
    """Sampled answers whose ids decode to text that re-encodes to other ids."""
    the, stop = t.tokenizer.convert_tokens_to_ids(["the", "<|im_end|>"])
    im_start = t.tokenizer.convert_tokens_to_ids("<|im_start|>")
    return {
        "cjk-cut-by-max-tokens": [the, byte_id(t, 0xE4), byte_id(t, 0xB8)],
        "emoji-cut-by-max-tokens": [the, byte_id(t, 0xF0), byte_id(t, 0x9F), byte_id(t, 0x98)],
        "invalid-utf8": [byte_id(t, 0xFF), byte_id(t, 0x80), the, byte_id(t, 0xC0), stop],
        "nul": [the, byte_id(t, 0x00), the, stop],
        "special-mid-answer": [the, im_start, the, stop],
    }


CASES = [
    "cjk-cut-by-max-tokens",
    "emoji-cut-by-max-tokens",
    "invalid-utf8",
    "nul",
    "special-mid-answer",
]


def turn(prompt: list[int], out: list[int], spliced: bool) -> SimpleNamespace:
    """A stored completion as `sampled_stream` reads it."""
    return SimpleNamespace(prompt_token_ids=prompt, output_token_ids=out, spliced=spliced)


def play(t: ChatTemplate, outs: list[list[int]]) -> list[SimpleNamespace]:
    """Turns as the gateway builds them: the agent echoes `decode(out)` of every answer."""
    messages = [{"role": "user", "content": "what is one plus two?"}]
    chain: list[SimpleNamespace] = []  # nearest first
    prompt, spliced = t.render(messages), False
    for k, out in enumerate(outs):
        chain.insert(0, turn(prompt, out, spliced))
        messages = [
            *messages,
            {"role": "assistant", "content": t.decode(out)},
            {"role": "user", "content": f"and then {k}?"},
        ]
        stream, spans = sampled_stream(chain)
        prompt, spliced = t.continue_from(stream, messages, None, spans)
    chain.insert(0, turn(prompt, [], spliced))
    return chain[::-1]


@pytest.mark.parametrize("case", CASES)
def test_byte_answers_do_not_round_trip(plain: ChatTemplate, case: str) -> None:
    out = answers(plain)[case]
    assert plain.encode(plain.decode(out)) != out


@pytest.mark.parametrize("case", CASES)
def test_every_turn_after_a_byte_answer_splices_its_ids(plain: ChatTemplate, case: str) -> None:
    out = answers(plain)[case]
    turns = play(plain, [out, out, out])
    assert [t.spliced for t in turns] == [False, True, True, True]
    for parent, child in itertools.pairwise(turns):
        seen = parent.prompt_token_ids + parent.output_token_ids
        assert child.prompt_token_ids[: len(seen)] == seen


@pytest.mark.parametrize("case", ["nul", "special-mid-answer"])
def test_decoding_the_whole_stream_as_text_drifted(plain: ChatTemplate, case: str) -> None:
    """The old rule (no answer spans: one decode of prompt + output) re-tokenized these."""
    out = answers(plain)[case]
    messages = [{"role": "user", "content": "hi"}]
    prompt = plain.render(messages)
    follow = [*messages, {"role": "assistant", "content": plain.decode(out)}]
    follow.append({"role": "user", "content": "and?"})
    span = (len(prompt), len(prompt) + len(out))
    assert plain.continue_from(prompt + out, follow)[1] is False
    assert plain.continue_from(prompt + out, follow, None, [span])[1] is True


def test_an_answer_the_agent_changed_is_not_spliced(plain: ChatTemplate) -> None:
    out = answers(plain)["cjk-cut-by-max-tokens"]
    messages = [{"role": "user", "content": "hi"}]
    prompt = plain.render(messages)
    edited = plain.decode(out).replace("\ufffd", "?")
    follow = [*messages, {"role": "assistant", "content": edited}, {"role": "user", "content": "?"}]
    ids, spliced = plain.continue_from(prompt + out, follow, None, [(len(prompt), len(prompt) + 3)])
    assert not spliced and ids == plain.render(follow)


def test_a_template_that_rewrites_history_still_drifts(thinking: ChatTemplate) -> None:
    """The documented rule: the template's history wins; the turns train apart."""
    stop = thinking.tokenizer.convert_tokens_to_ids("<|im_end|>")
    think = [*thinking.encode("<think>hm</think> "), byte_id(thinking, 0xE4), stop]
    turns = play(thinking, [answers(thinking)["nul"], think, answers(thinking)["nul"]])
    # the turn after the <think> answer drifts; the turn after that splices again
    assert [t.spliced for t in turns] == [False, True, False, True]


def test_sampled_stream_spans_stop_at_a_drifted_turn() -> None:
    root = turn([1, 2], [3, 4], spliced=False)
    second = turn([1, 2, 3, 4, 5], [6], spliced=True)
    third = turn([1, 2, 3, 4, 5, 6, 7], [8, 9], spliced=True)
    stream, spans = sampled_stream([third, second, root])
    assert stream == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert spans == [(2, 4), (5, 6), (7, 9)]
    redrawn = turn([1, 2, 3, 4, 5, 6, 7], [8, 9], spliced=False)  # its history re-rendered
    assert sampled_stream([redrawn, second, root])[1] == [(7, 9)]
