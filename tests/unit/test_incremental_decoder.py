"""The streaming decoder's deltas, from a window of the last ids, are exactly those of decoding
the whole list at each token (the old way, quadratic in the output's length): the same
pieces at the same tokens, stop strings and unfinished characters held back alike."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.agent.streaming import IncrementalDecoder
from inference.chat_template import ChatTemplate, ids_decoder
from inference.types import truncate_at_stop


class WholeListDecoder:
    """The reference: decode every id so far at each token."""

    def __init__(self, decode, stop: tuple[str, ...] = ()) -> None:
        self.decode, self.stop, self.ids, self.sent = decode, stop, [], ""

    def _visible(self, text: str, final: bool) -> str:
        cut = truncate_at_stop(text, self.stop)
        if cut != text or final:
            return cut
        hold = max(
            (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
        return text[: len(text) - hold]

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        return "" if text.endswith("\ufffd") else self._advance(self._visible(text, False))

    def flush(self) -> str:
        return self._advance(self._visible(self.decode(self.ids), True))

    def _advance(self, visible: str) -> str:
        if not visible.startswith(self.sent):
            return ""
        piece, self.sent = visible[len(self.sent) :], visible
        return piece


def _sentencepiece_like() -> Tokenizer:
    """A small Llama-2-style tokenizer: Metaspace, byte fallback, and a decoder that strips
    the first token's leading space, so decoding a slice is not a slice of the decoding."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"])
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "STOP here"] * 20, trainer
    )
    tok.add_tokens([f"<0x{i:02X}>" for i in range(256)])  # byte tokens, as Llama's vocab has
    return tok


@pytest.mark.parametrize("seed", range(40))
def test_a_decoder_that_strips_the_first_space(seed) -> None:
    tok = _sentencepiece_like()
    rng = random.Random(seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    stop = rng.choice([(), ("STOP",), ("the q",)])

    def decode(xs):
        return tok.decode(xs, skip_special_tokens=True)

    ours, ref = IncrementalDecoder(decode, stop), WholeListDecoder(decode, stop)
    for token in ids:
        assert ours.push(token) == ref.push(token)
    assert ours.flush() == ref.flush()


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


def _ids(template: ChatTemplate, rng: random.Random) -> list[int]:
    """Text with multi-byte characters, raw byte tokens cut from theirs, and specials."""
    text = "".join(
        rng.choice(["ab", " c", "é", "日本", "😀", "\n", "STOP", "<|im_end|>"]) for _ in range(30)
    )
    ids = template.encode(text)
    vocab = len(template.tokenizer)
    for _ in range(rng.randint(0, 4)):  # stray tokens anywhere, byte tokens included
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(vocab))
    return ids


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("raw", [False, True])
def test_the_same_pieces_as_decoding_the_whole_list(template, seed, raw) -> None:
    rng = random.Random(seed)
    ids = _ids(template, rng)
    stop = rng.choice([(), ("STOP",), ("日本", "xyz")])
    if raw:  # text completions keep special tokens

        def decode(xs):
            return template.tokenizer.decode(xs, skip_special_tokens=False)
    else:
        decode = template.decode
    ours, ref = IncrementalDecoder(decode, stop), WholeListDecoder(decode, stop)
    for token in ids:
        assert ours.push(token) == ref.push(token)
    assert ours.flush() == ref.flush()
    assert ours.sent == ref.sent


@pytest.mark.parametrize("seed", range(40))
def test_template_decoding_is_transformers_decoding(template, seed) -> None:
    """`ChatTemplate` decodes with the fast tokenizer's own decode: the same text as
    transformers' `decode` without clean-up, special tokens skipped or kept."""
    ids = _ids(template, random.Random(seed))
    tok = template.tokenizer
    kept = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    skipped = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert template.template_text(ids) == kept
    assert template.decode(ids) == skipped.replace("\x00", "\ufffd")


def test_a_tokenizer_without_a_fast_backend_decodes_through_transformers() -> None:
    calls = []
    slow = SimpleNamespace(decode=lambda ids, **kw: calls.append((ids, kw)) or "text")
    assert ids_decoder(slow)([1, 2], False) == "text"
    no_cleanup = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    assert calls == [([1, 2], no_cleanup)]
