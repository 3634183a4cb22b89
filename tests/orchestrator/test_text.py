"""Incremental detokenization and stop strings."""

from __future__ import annotations

from typing import ClassVar

from tiny import make_tokenizer

from orchestrator.text import TextStream

TOKENIZER = make_tokenizer()


def feed(text: str, stops: tuple[str, ...] = ()) -> tuple[TextStream, list[str]]:
    stream = TextStream(TOKENIZER, stops)
    pieces = []
    for token in TOKENIZER.encode(text):
        stream.add(token)
        pieces.append(stream.take())
        if stream.stopped:
            break
    pieces.append(stream.take(final=True))
    return stream, pieces


def test_pieces_join_to_the_decoded_text() -> None:
    stream, pieces = feed("def f(x):\n  return x")
    assert "".join(pieces) == "def f(x):\n  return x"
    assert not stream.stopped


def test_stop_string_spanning_tokens_is_cut_and_never_streamed() -> None:
    stream, pieces = feed("abc stop here", ("stop",))
    assert stream.stopped
    assert "".join(pieces) == "abc "
    assert all("s" not in p for p in pieces)
    # Tokens through the one that completed the stop string are kept.
    assert len(stream.token_ids) == len("abc stop")


def test_earliest_of_several_stop_strings_wins() -> None:
    _, pieces = feed("one two three", ("three", "two"))
    assert "".join(pieces) == "one "


def test_partial_stop_string_is_released_at_the_end() -> None:
    stream, pieces = feed("hello st", ("stop",))
    assert not stream.stopped
    assert "".join(pieces) == "hello st"


def test_fast_decoder_gives_the_tokenizers_own_text() -> None:
    """The Rust-only decode must equal tokenizer.decode, specials skipped, on any ids; a
    tokenizer that cleans up spaces keeps its own decode."""
    import random

    from orchestrator.text import decoder

    decode, rng = decoder(TOKENIZER), random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(TOKENIZER)) for _ in range(rng.randrange(0, 12))]
        assert decode(ids) == TOKENIZER.decode(ids, skip_special_tokens=True)
    cleaning = make_tokenizer()
    cleaning.clean_up_tokenization_spaces = True
    calls: list[list[int]] = []
    original = cleaning.decode
    cleaning.decode = lambda ids, **kw: calls.append(ids) or original(ids, **kw)  # type: ignore[method-assign]
    assert decoder(cleaning)([5, 6]) == original([5, 6], skip_special_tokens=True) and calls == [[5, 6]]


class ByteTokenizer:
    """Tokens that are byte strings, decoded as a byte-level BPE does: a split character
    shows as U+FFFD until its last byte arrives."""

    clean_up_tokenization_spaces = False
    PIECES: ClassVar[dict[int, bytes]] = {1: b"Say", 2: b":", 3: b" \xe6", 4: b"\x97\xa5"}  # 3 + 4: " 日"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", "replace")


def _stream(ids: list[int], stops: tuple[str, ...]) -> tuple[TextStream, str]:
    stream, out = TextStream(ByteTokenizer(), stops), []
    for token in ids:
        stream.add(token)
        out.append(stream.take())
        if stream.stopped:
            break
    out.append(stream.take(final=True))
    return stream, "".join(out)


def test_a_stop_string_before_an_incomplete_character_stops_at_once() -> None:
    # ": " is complete once token 3 (a space and half a character) arrives.
    stream, text = _stream([1, 2, 3, 4], (": ",))
    assert stream.stopped and text == "Say" and stream.token_ids == [1, 2, 3]


def test_a_stop_string_in_the_final_incomplete_character_is_still_cut() -> None:
    # Generation ends (length or EOS) after token 3: the flush must look for stop strings too.
    stream, text = _stream([1, 2, 3], (": ",))
    assert stream.stopped and text == "Say"


def test_a_completed_character_streams_whole() -> None:
    stream, text = _stream([1, 2, 3, 4], ())
    assert not stream.stopped and text == "Say: 日"


def test_the_first_token_keeps_its_leading_space_after_the_prompt() -> None:
    """A SentencePiece decoder drops the space that starts a text; the first generated token
    is not the start of the text, so the prompt's last tokens are decoded before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")  # type: ignore[no-untyped-call]
    stream = TextStream(tokenizer, (), prompt_token_ids=[1])
    for token in (2, 3):
        stream.add(token)
    assert stream.take(final=True) == " world!"
