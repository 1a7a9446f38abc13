"""Stop strings found in a growing text in linear time, whatever the stop strings are.

Sampling ends once the text contains a stop string, and a stream must hold back
any tail that could still become one. Testing `text.endswith(s[:k])` for every k
on every token costs the stop strings' length per token; a long stop string made
each token of a stream that slow, on the thread every other request shares.

`StopMatcher` is an Aho-Corasick automaton over the stop strings (built once per
distinct tuple of them, `_automaton`), fed the text piece by piece. Its state is
the longest suffix of the text so far that is a prefix of some stop string, so
both questions a caller asks are answered from it in O(1):

* `match`: where the earliest occurrence of any stop string starts (the text
  before it is what OpenAI returns: the stop string itself is left out);
* `hold`: the length of the longest suffix of the text that is a proper prefix
  of a stop string (what a stream must not send yet).

Each fed character costs O(1) amortised: a step moves one level deeper in the
trie at most, and every failure link followed moves at least one level up.
`TextStop` puts it behind a token stream for a backend that samples token ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from inference.detokenize import Detokenizer


@dataclass(frozen=True)
class _Automaton:
    """The trie of the stop strings with Aho-Corasick's links, one entry per node (0: root)."""

    goto: tuple[dict[str, int], ...]  # the trie's edges
    fail: tuple[int, ...]  # the node of the longest proper suffix that is in the trie
    depth: tuple[int, ...]  # the length of the node's string
    # The length of the longest stop string that is a suffix of the node's string (0: none),
    # so that the earliest-starting match ending here is known without walking the links.
    out: tuple[int, ...]
    # The length of the longest suffix of the node's string that is a PROPER prefix of some
    # stop string: the node itself unless it is a whole stop string and nothing longer.
    held: tuple[int, ...]


@lru_cache(maxsize=256)
def _automaton(stop: tuple[str, ...]) -> _Automaton:
    goto: list[dict[str, int]] = [{}]
    depth, ends = [0], [0]
    for s in stop:
        node = 0
        for ch in s:
            nxt = goto[node].get(ch)
            if nxt is None:
                nxt = len(goto)
                goto[node][ch] = nxt
                goto.append({})
                depth.append(depth[node] + 1)
                ends.append(0)
            node = nxt
        ends[node] = len(s)
    fail, out, held = [0] * len(goto), list(ends), [0] * len(goto)
    queue = deque([0])
    while queue:  # breadth first: a node's failure link is shallower, so already final
        node = queue.popleft()
        out[node] = ends[node] or out[fail[node]]
        held[node] = depth[node] if goto[node] else held[fail[node]]
        for ch, child in goto[node].items():
            if node:
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
            queue.append(child)
    return _Automaton(tuple(goto), tuple(fail), tuple(depth), tuple(out), tuple(held))


class StopMatcher:
    """Feed it a text in pieces; it knows where the first stop string starts and what to hold."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._auto = _automaton(tuple(stop))
        self.reset()

    def reset(self) -> None:
        """Forget the text fed so far."""
        self._node = 0
        self.length = 0  # characters fed
        self.match: int | None = None  # start of the earliest stop string in the text

    def feed(self, piece: str) -> None:
        goto, fail, out = self._auto.goto, self._auto.fail, self._auto.out
        node, pos, match = self._node, self.length, self.match
        for ch in piece:
            nxt = goto[node].get(ch)
            while nxt is None and node:
                node = fail[node]
                nxt = goto[node].get(ch)
            node = nxt or 0
            pos += 1
            if out[node] and (match is None or pos - out[node] < match):
                match = pos - out[node]
        self._node, self.length, self.match = node, pos, match

    @property
    def hold(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return self._auto.held[self._node]

    def visible(self) -> int:
        """How much of the text may be sent: up to the first stop string, else all but `hold`."""
        return self.match if self.match is not None else self.length - self.hold


class TextStop:
    """Whether the text of a growing list of sampled ids contains a stop string yet.

    For a backend that samples ids and must end a row at the token whose text
    completes a stop string: each token decodes a window of a few ids
    (`Detokenizer`) and feeds what it added to a `StopMatcher`.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self._text = Detokenizer(decode)
        self._matcher = StopMatcher(stop)

    def push(self, token: int) -> bool:
        piece = self._text.push(token)
        if piece is None:  # the text was rewritten, not extended: read it again
            self._matcher.reset()
            piece = self._text.text
        self._matcher.feed(piece)
        return self._matcher.match is not None
