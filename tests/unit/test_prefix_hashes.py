"""The candidate parents' hashes, computed in one pass, are exactly `conversation_hash` of each
prefix that ends in an assistant message (what a stored completion's `conv_hash` holds)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agent.episodes import assistant_prefix_hashes, conversation_hash

_call = st.fixed_dictionaries(
    {
        "id": st.text(max_size=4),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.text(max_size=4),
                "arguments": st.sampled_from(['{"b":1,"a":[2]}', "x", ""]),
            }
        ),
    }
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(st.none(), st.text(max_size=12)),
    },
    optional={"tool_calls": st.lists(_call, max_size=2)},
)


@settings(deadline=None)  # a loaded machine is slow, not wrong
@given(st.lists(_message, max_size=8))
def test_one_pass_equals_hashing_each_prefix(messages: list[dict]) -> None:
    want = {
        conversation_hash(messages[:end]): end
        for end in range(1, len(messages))
        if messages[end - 1]["role"] == "assistant"
    }
    assert assistant_prefix_hashes(messages) == want


def test_the_last_message_is_never_a_candidate() -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert assistant_prefix_hashes(msgs) == {}
    assert list(assistant_prefix_hashes([*msgs, {"role": "user", "content": "c"}]).values()) == [2]
