"""The `<think>` split (issue #24): whole, streamed in any pieces, and its token count."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference.reasoning import ThinkStream, opens_think, split_reasoning, think_token_count


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # Qwen3, DeepSeek-R1
        ("<|im_start|>assistant\n<think>", True),
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, thinking off
        ("<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n", False),
    ],
)
def test_opens_think_reads_the_end_of_the_prompt(prompt: str, opened: bool) -> None:
    assert opens_think(prompt) is opened


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nadd them\n</think>\n\nIt is 3.", False, ("add them", "It is 3.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("It is 3.", False, (None, "It is 3.")),
        ("  It is <think>3</think>", False, (None, "  It is <think>3</think>")),
        ("<think>still thinking", False, ("still thinking", "")),  # cut by max_tokens
        ("<thi", False, (None, "<thi")),
        ("", False, (None, "")),
        ("add them\n</think>\n\nIt is 3.", True, ("add them", "It is 3.")),
        ("</think>It is 3.", True, ("", "It is 3.")),
        ("still thinking ", True, ("still thinking", "")),
        ("a</think>b</think>c", True, ("a", "b</think>c")),
    ],
)
def test_split_reasoning(text: str, opened: bool, want: tuple[str | None, str]) -> None:
    assert split_reasoning(text, opened) == want


def streamed(pieces: list[str], opened: bool) -> tuple[str, str, list[tuple[str, str]]]:
    think = ThinkStream(opened)
    deltas = [think.push(p) for p in pieces] + [think.flush()]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


def test_stream_sends_reasoning_before_the_close_and_content_after() -> None:
    pieces = ["<", "think", ">", "\n", "add", " them", "\n</", "thi", "nk>", "\n\n", "It", " is 3."]
    _, _, deltas = streamed(pieces, opened=False)
    assert deltas == [
        ("", ""),  # could still be <think>
        ("", ""),
        ("", ""),
        ("", ""),  # leading whitespace of the reasoning is stripped
        ("add", ""),
        (" them", ""),
        ("", ""),  # "\n</" could start </think>, and the newline could end the reasoning
        ("", ""),
        ("", ""),  # closed: the held whitespace was the reasoning's end
        ("", ""),  # leading whitespace of the answer is stripped
        ("", "It"),
        ("", " is 3."),
        ("", ""),
    ]


def test_stream_without_think_sends_text_as_soon_as_it_cannot_be_a_tag() -> None:
    _, _, deltas = streamed([" <", "b>", "old"], opened=False)
    assert deltas == [("", ""), ("", " <b>"), ("", "old"), ("", "")]


def test_stream_releases_a_held_tail_that_did_not_close() -> None:
    reasoning, content, deltas = streamed(["a </th", "ing> b "], opened=True)
    assert deltas[0] == ("a", "")
    assert (reasoning, content) == ("a </thing> b", "")


text_parts = st.sampled_from(
    ["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b c"]
)


@given(
    parts=st.lists(text_parts, max_size=12), cuts=st.lists(st.integers(0, 60)), opened=st.booleans()
)
def test_stream_joins_to_the_whole_split(parts: list[str], cuts: list[int], opened: bool) -> None:
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[i:j] for i, j in itertools.pairwise(bounds)]
    reasoning, content, _ = streamed(pieces, opened)
    want_reasoning, want_content = split_reasoning(text, opened)
    assert (reasoning, content) == (want_reasoning or "", want_content)


def test_think_token_count_stops_at_the_token_that_closes() -> None:
    tokens = ["<th", "ink>", "a", "</", "think", ">", "b"]

    def decode(ids: list[int]) -> str:
        return "".join(tokens[i] for i in ids)

    assert think_token_count(list(range(7)), decode) == 6
    assert think_token_count(list(range(5)), decode) == 5  # never closed: all of it thinks
