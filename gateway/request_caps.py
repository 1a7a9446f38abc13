"""The caps on agent request fields that drive the gateway's CPU or memory, in one place.

A body is already bounded in bytes (the body-size limit), but a few bytes per
item still make a lot of items: each message, content part and tool is a model
to validate and a piece of template to render, each stop string is matched
against every streamed character, and each choice (`n`) is a whole sampling.
These caps bound that work per request. A request over one is refused before
any of it is done, with the API family's 400 naming the field (`param`).

The defaults follow OpenAI's published limits where it has them, and are wide
enough that no ordinary request meets them. `max_tokens` has no cap of its own:
the prompt plus `max_tokens` must fit the model's context, checked once the
prompt is rendered (`gateway.agent.completions.sampling_params`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestCaps:
    """The largest value each capped request field may take."""

    # Stop strings per request (`stop`, `stop_sequences`): OpenAI's cap, and the one
    # `inference.types.SamplingParams` enforces for every backend.
    stop_strings: int = 4
    # Characters per stop string. The matcher is linear whatever their length
    # (`inference.stop_strings`), but its automaton is built per request and a
    # stream holds back up to this many characters; a real stop string is a few.
    stop_string_chars: int = 1_000
    # Messages per request (`messages`; Responses' `input` items): OpenAI's cap.
    messages: int = 2_048
    # Content parts (blocks) per message, and in Anthropic's `system`.
    content_parts: int = 1_024
    # Tools per request: OpenAI's cap on functions.
    tools: int = 128
    # `logit_bias` entries: OpenAI's cap (token id -> bias).
    logit_bias: int = 300
    # Choices per chat completion: each one is a whole sampling and a stored row.
    n: int = 16
    # Any token count (`max_tokens` and its kin, `top_k`, a thinking budget): the largest
    # a backend takes (int32). The prompt plus `max_tokens` must also fit the context; this
    # only keeps a 100,000-digit integer from reaching arithmetic and error messages.
    token_count: int = 2**31 - 1


CAPS = RequestCaps()


def check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    """A pydantic validator for `stop` / `stop_sequences`: count and length within the caps."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > CAPS.stop_strings:
        raise ValueError(f"at most {CAPS.stop_strings} stop strings are allowed")
    if any(not s for s in strings):
        raise ValueError("a stop string must not be empty")
    if any(len(s) > CAPS.stop_string_chars for s in strings):
        raise ValueError(f"a stop string may be at most {CAPS.stop_string_chars} characters long")
    return stop


def check_parts(content: str | list | None) -> str | list | None:
    """A pydantic validator for a message's content: at most `CAPS.content_parts` parts."""
    if isinstance(content, list) and len(content) > CAPS.content_parts:
        raise ValueError(f"at most {CAPS.content_parts} content parts are allowed per message")
    return content
