"""Incremental detokenization and stop strings."""

from __future__ import annotations

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
