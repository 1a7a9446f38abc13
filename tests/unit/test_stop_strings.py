"""The stop-string matcher agrees with the plain definitions, and costs the same per token
at the end of a long stream as at its start, whatever the stop strings are."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agent.streaming import IncrementalDecoder
from gateway.request_caps import CAPS
from inference.stop_strings import StopMatcher, TextStop, _automaton
from inference.types import truncate_at_stop


def earliest(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the earliest occurrence of any stop string starts."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def longest_held(text: str, stop: tuple[str, ...]) -> int:
    """The longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


# A small alphabet so that stop strings overlap, repeat and occur often.
_text = st.text(alphabet="abcé日", max_size=40)
_stops = st.lists(st.text(alphabet="abcé日", min_size=1, max_size=6), max_size=5).map(tuple)


@settings(max_examples=400, deadline=None)
@given(stop=_stops, pieces=st.lists(_text, max_size=8))
def test_the_matcher_is_the_plain_definition_after_every_piece(stop, pieces) -> None:
    m, text = StopMatcher(stop), ""
    for piece in pieces:
        m.feed(piece)
        text += piece
        assert m.length == len(text)
        assert m.match == earliest(text, stop)
        if m.match is None:
            assert m.hold == longest_held(text, stop)
            assert m.visible() == len(text) - longest_held(text, stop)
        else:
            assert m.visible() == len(truncate_at_stop(text, stop))


@settings(max_examples=200, deadline=None)
@given(stop=_stops, text=_text)
def test_reset_forgets_the_text(stop, text) -> None:
    m = StopMatcher(stop)
    m.feed("abcabc日é")
    m.reset()
    m.feed(text)
    assert (m.match, m.length) == (earliest(text, stop), len(text))


def _chars(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 3) for i in ids)


@settings(max_examples=200, deadline=None)
@given(stop=_stops, ids=st.lists(st.integers(0, 8), max_size=40))
def test_a_stream_holds_back_a_possible_stop_string_and_never_sends_one(stop, ids) -> None:
    decoder = IncrementalDecoder(_chars, stop)
    for i in range(len(ids)):
        decoder.push(ids[i])
        text = _chars(ids[: i + 1])
        cut = truncate_at_stop(text, stop)
        assert decoder.sent == (
            cut if cut != text else text[: len(text) - longest_held(text, stop)]
        )
    decoder.flush()
    assert decoder.sent == truncate_at_stop(_chars(ids), stop)
    assert decoder.n_sent == len(decoder.sent)


@settings(max_examples=200, deadline=None)
@given(stop=_stops, ids=st.lists(st.integers(0, 8), max_size=40))
def test_a_backend_row_stops_at_the_token_that_completes_a_stop_string(stop, ids) -> None:
    check = TextStop(_chars, stop) if stop else None
    first = next(
        (i for i in range(len(ids)) if earliest(_chars(ids[: i + 1]), stop) is not None), None
    )
    hits = [check.push(t) if check else False for t in ids]
    assert (hits.index(True) if True in hits else None) == first


def test_an_empty_stop_string_is_refused() -> None:
    try:
        StopMatcher(("a", ""))
    except ValueError:
        return
    raise AssertionError("an empty stop string was accepted")


# --- cost: flat per token at the caps --------------------------------------------------------

TOKENS = 32_768
CHARS_PER_TOKEN = 3


def _stops_at_the_caps() -> tuple[str, ...]:
    """The worst case for a naive matcher: every stop string as long as allowed, and a text
    that keeps almost matching all of them (a run of 'a's; each one ends in 'b')."""
    n, length = CAPS.stop_strings, CAPS.stop_string_chars
    return tuple("a" * (length - 1 - i) + "b" for i in range(n))


def _per_token(feed, pieces: list[str]) -> list[float]:
    times = []
    for piece in pieces:
        t0 = time.perf_counter()
        feed(piece)
        times.append(time.perf_counter() - t0)
    return times


def test_time_per_token_is_flat_over_a_32k_token_stream_at_the_caps() -> None:
    """The last thousand tokens of a 32k-token stream cost what the first thousand did
    (the best of five runs each, so that a scheduler hiccup is not read as growth)."""
    stop = _stops_at_the_caps()
    pieces = ["a" * CHARS_PER_TOKEN] * TOKENS
    firsts, lasts = [], []
    for _ in range(5):
        m = StopMatcher(stop)
        times = _per_token(m.feed, pieces)
        assert m.match is None and m.hold == CAPS.stop_string_chars - 1
        firsts.append(sum(times[:1000]))
        lasts.append(sum(times[-1000:]))
    assert min(lasts) / min(firsts) < 3


def _decoder_times(stop: tuple[str, ...]) -> list[float]:
    decoder = IncrementalDecoder(lambda ids: "a" * (CHARS_PER_TOKEN * len(ids)), stop)
    times = _per_token(decoder.push, [0] * TOKENS)
    held = max((len(s) - 1 for s in stop), default=0)
    assert decoder.n_sent == CHARS_PER_TOKEN * TOKENS - held
    return times


def test_the_streaming_decoder_is_flat_and_stop_strings_add_little() -> None:
    """The gateway's stream decoder: flat per token over 32k tokens at the caps, and not
    much dearer than the same stream without stop strings (the best of three runs each)."""
    stop = _stops_at_the_caps()
    runs = [_decoder_times(stop) for _ in range(3)]
    plain = min(sum(_decoder_times(())) for _ in range(3))
    assert min(sum(t[-1000:]) for t in runs) / min(sum(t[:1000]) for t in runs) < 3
    assert min(sum(t) for t in runs) / plain < 3


class _Counting(dict):
    """A trie node's edges that count the lookups made through them."""

    lookups = 0

    def get(self, key, default=None):
        _Counting.lookups += 1
        return super().get(key, default)


def test_transitions_per_character_are_bounded_whatever_the_stop_strings() -> None:
    """Deterministic: edge lookups over the whole stream are at most twice its characters
    (each character moves one level down at most; each failure link followed moves up)."""
    stop = _stops_at_the_caps()
    auto = _automaton(stop)
    counted = type(auto)(
        tuple(_Counting(g) for g in auto.goto), auto.fail, auto.depth, auto.out, auto.held
    )
    m = StopMatcher(stop)
    m._auto = counted
    text = ("a" * 1500 + "c") * 20 + "a" * 999 + "b"
    _Counting.lookups = 0
    for i in range(0, len(text), CHARS_PER_TOKEN):
        m.feed(text[i : i + CHARS_PER_TOKEN])
    assert _Counting.lookups <= 2 * len(text)
    assert m.match == earliest(text, stop)
