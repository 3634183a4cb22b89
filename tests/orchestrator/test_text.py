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
