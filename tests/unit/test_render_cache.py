"""The rendered-prompt cache: a hit gives exactly the ids a fresh render gives, and no more
than its budget is held."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.chat_template import ChatTemplate
from inference.render_cache import RenderCache, prompt_key

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


def _messages(user: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": user},
        {"role": "assistant", "content": "Which city?"},
        {"role": "user", "content": "Paris"},
    ]


def test_a_hit_is_the_render_and_a_fresh_list(template: ChatTemplate) -> None:
    msgs = _messages("weather?")
    assert template.lookup(msgs, TOOLS) is None
    first = template.render(msgs, TOOLS)
    assert first == template.encode(template.render_text(msgs, TOOLS))
    hit = template.lookup(msgs, TOOLS)
    assert hit == first and hit is not first
    hit.append(-1)  # a caller's list is its own
    assert template.render(msgs, TOOLS) == first
    assert (template.cache.hits, template.cache.misses) == (2, 1)


def test_any_difference_is_a_miss(template: ChatTemplate) -> None:
    template.render(_messages("weather?"), TOOLS)
    assert template.lookup(_messages("weather!"), TOOLS) is None
    assert template.lookup(_messages("weather?"), None) is None
    other = [dict(m) for m in _messages("weather?")]
    other[0]["name"] = "x"
    assert template.lookup(other, TOOLS) is None


def test_the_budget_evicts_the_least_recently_used() -> None:
    cache = RenderCache(max_bytes=3 * (len(prompt_key([{"c": "a"}], None)) + 4 * 10))
    keys = [prompt_key([{"c": c}], None) for c in "abcd"]
    for k in keys[:3]:
        cache.put(k, list(range(10)))
    assert cache.get(keys[0]) is not None  # a is now the most recent
    cache.put(keys[3], list(range(10)))
    assert [cache.get(k) is not None for k in keys] == [True, False, True, True]
    cache.put(prompt_key([{"c": "big"}], None), list(range(1000)))  # over budget: not held
    assert len(cache) == 3


def test_a_key_needs_plain_json() -> None:
    assert prompt_key([{"role": "user", "content": object()}], None) is None
    cache = RenderCache()
    cache.put(None, [1, 2])
    assert cache.get(None) is None and len(cache) == 0


def test_a_template_that_reads_the_clock_is_not_cached(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = tmp_path / "dated"
    d.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    (d / "chat_template.jinja").write_text(
        "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    dated = ChatTemplate(d)
    msgs = [{"role": "user", "content": "hi"}]
    dated.render(msgs)
    assert dated.lookup(msgs) is None
