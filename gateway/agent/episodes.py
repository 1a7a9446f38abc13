"""Where a chat call belongs: its episode, its group, and its parent turn.

Order (design.md, flow 3): the URL path, then the X-Episode-Id / X-Group-Id
headers, then the request's `metadata`. The parent is the earlier completion
of the run (of that episode, when one was named) whose messages plus answer
form the longest prefix of this call's messages, created within
`prefix_match_window_s`. A call that names no episode joins its parent's
episode ("prefix"), or else starts a new one ("new").
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from core.store.lineage import Lineage
from core.store.models import Completion
from gateway.identifiers import checked_id

EVAL_PREFIX = "/eval"  # every agent endpoint again, for held-out calls (`EpisodeRef.evaluation`)
VERSION_HEADER = "X-Rlgate-Version"  # the kept version an evaluation call pins


@dataclass(frozen=True)
class EpisodeRef:
    """Ids from the URL path and headers (the router fills it)."""

    episode_id: str | None = None
    group_id: str | None = None
    source: str | None = None  # "path" or "header"
    # Called under `/eval`: held out, served and scored, never trained (`EpisodeStatus.EVAL`).
    evaluation: bool = False
    version: int | None = None  # `X-Rlgate-Version`: the kept version an evaluation call pins


@dataclass(frozen=True)
class Placement:
    episode_id: str
    group_id: str | None  # None: keep the episode's group (or the ungrouped pool)
    link: str  # path | header | metadata | prefix | new
    parent: Completion | None
    evaluation: bool = False  # held out: an `/eval` call (`EpisodeRef.evaluation`)
    # The episode was begun by another policy of the run (docs/policies.md): it was
    # admitted there, and this policy's turns join it (`ChatService._policy_placement`).
    joined: bool = False


# Evaluation conversations hash in a space of their own: prefix matching looks a call's
# parent up by hash, so an evaluation call never joins a training episode nor the reverse.
EVAL_SPACE = b"eval\x00"


def conversation_hash(messages: list[dict[str, Any]], *, evaluation: bool = False) -> str:
    """Order- and content-exact hash of normalised messages (role, text, tool fields).

    A tool call's arguments count as the JSON value they spell, not as their text:
    Anthropic's clients echo a call's `input` as an object, OpenAI's as the string.
    """
    canonical = _CANONICAL_JSON.encode([_canonical_calls(m) for m in messages])
    return hashlib.sha256(EVAL_SPACE * evaluation + canonical.encode()).hexdigest()


# json.dumps with these options builds this encoder anew on every call.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical(message: dict[str, Any]) -> str:
    return _CANONICAL_JSON.encode(_canonical_calls(message))


def assistant_prefix_hashes(
    messages: list[dict[str, Any]], *, evaluation: bool = False
) -> dict[str, int]:
    """`conversation_hash(messages[:end])` -> `end`, for each prefix that ends in an assistant
    message (the candidate parents), in one pass: each message is encoded once and the
    prefixes share one running hash (a list's compact JSON is its items' joined by commas)."""
    running = hashlib.sha256(EVAL_SPACE * evaluation + b"[")
    out: dict[str, int] = {}
    for end, message in enumerate(messages[:-1], start=1):
        running.update(((end > 1) * "," + _canonical(message)).encode())
        if message.get("role") == "assistant":
            prefix = running.copy()
            prefix.update(b"]")
            out[prefix.hexdigest()] = end
    return out


def _canonical_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            out.append(call)  # not JSON: compared as text
            continue
        out.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}


def answer_message(content: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Our answer as the agent will echo it (the same shape as ChatMessage.normalized)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def with_sampled_answers(
    messages: list[dict[str, Any]], chain: list[Completion], decode
) -> list[dict[str, Any]]:
    """Replace each answer rlgate produced in `messages` by the text the model sampled."""
    out = list(messages)
    for c in chain:
        i = len(c.messages)
        if i < len(out) and out[i].get("role") == "assistant":
            out[i] = {"role": "assistant", "content": decode(list(c.output_token_ids))}
    return out


def sampled_stream(chain: list[Completion]) -> tuple[list[int], list[tuple[int, int]]]:
    """The parent's prompt + output ids, and the span of each answer rlgate sampled in them.

    `chain` is the parent's ancestry, nearest first. Each of those answers is
    an assistant message of the call (`find_parent` matched the call's
    messages against what rlgate returned, U+FFFD and tool calls included), so
    the template gets its content and the splice keeps its ids, whether or not
    those ids survive a trip through text. The parent's answer ends the
    stream; an older one is in it as sampled while every turn after it was
    spliced (a drifted turn re-rendered its history from text).
    """
    parent = chain[0]
    stream = [*parent.prompt_token_ids, *parent.output_token_ids]
    spans: list[tuple[int, int]] = []
    for k, c in enumerate(chain):
        if k and not chain[k - 1].spliced:
            break
        start = len(c.prompt_token_ids)
        end = start + len(c.output_token_ids)
        if stream[start:end] != list(c.output_token_ids):
            break
        spans.append((start, end))
    return stream, spans[::-1]


def explicit_ids(
    ref: EpisodeRef, metadata: dict[str, str] | None
) -> tuple[str | None, str | None, str | None]:
    """(episode id, group id, source) from path/headers, else metadata; ids are validated."""
    meta = metadata or {}
    episode = ref.episode_id or meta.get("episode_id")
    group = ref.group_id or meta.get("group_id")
    source = ref.source if ref.episode_id else ("metadata" if meta.get("episode_id") else None)
    if episode is not None:
        checked_id(episode, "episode_id")
    if group is not None:
        checked_id(group, "group_id")
    return episode, group, source


async def find_parent(
    lineage: Lineage,
    run_id: str,
    messages: list[dict[str, Any]],
    episode_id: str | None,
    window_s: float,
    *,
    evaluation: bool = False,
    family: list[str] | None = None,
) -> Completion | None:
    """The completion whose messages + answer are the longest prefix of `messages`.

    Every candidate prefix (one per assistant message) is looked up in one query; a
    call with no assistant message reads nothing. `evaluation`: look among evaluation
    conversations (`EVAL_SPACE`) instead of training ones. `family`: look among the
    turns of every run listed (the policies of one run), not only `run_id`'s.
    """
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    prefixes = assistant_prefix_hashes(messages, evaluation=evaluation)
    return await lineage.parent(run_id, prefixes, since, episode_id, family)


async def place(
    lineage: Lineage,
    run_id: str,
    ref: EpisodeRef,
    metadata: dict[str, str] | None,
    messages: list[dict[str, Any]],
    window_s: float,
    family: list[str] | None = None,
) -> Placement:
    episode_id, group_id, source = explicit_ids(ref, metadata)
    parent = await find_parent(
        lineage, run_id, messages, episode_id, window_s, evaluation=ref.evaluation, family=family
    )
    held_out = ref.evaluation
    if episode_id is not None:
        return Placement(episode_id, group_id, source or "header", parent, held_out)
    if parent is not None:  # the episode exists already, and with it its group
        return Placement(parent.episode_id, None, "prefix", parent, held_out)
    return Placement("ep-" + uuid.uuid4().hex, group_id, "new", None, held_out)
