"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of tokens (the offsets scheme of TGI and
vLLM), so each token costs O(window), not O(length). Text is held back while it ends
in an incomplete UTF-8 sequence, or could be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, without its Python wrapper when the
    wrapper adds nothing: a fast tokenizer that does no clean-up decodes in its Rust
    backend alone (about 60x quicker per call; this runs twice per generated token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: str(backend.decode(ids, skip_special_tokens=True))
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))


# Prompt tokens decoded before the first generated one, so the first token's text is what
# it adds after the prompt (a SentencePiece tokenizer drops the leading space of a text's
# first token), as vLLM and TGI do.
PROMPT_CONTEXT_TOKENS = 5


class TextStream:
    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...],
                 prompt_token_ids: tuple[int, ...] | list[int] = ()) -> None:
        self._decode = decoder(tokenizer)
        self.stop_strings = stop_strings
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""  # decoded so far (excluding anything after a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        # The decode window: prompt context, then generated tokens; text past _read_offset is
        # not in self.text yet (it ends in an incomplete character).
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._context = len(self._ids)  # where the generated tokens start
        self._prefix_offset, self._read_offset = 0, self._context

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens, through the one that completed a stop string."""
        return self._ids[self._context:]

    def add(self, token_id: int) -> None:
        """Append one token; sets `stopped` (and trims text) if a stop string completes."""
        self._ids.append(token_id)
        new = self._pending()
        if new.endswith("\ufffd"):
            # The token's last character is incomplete: hold its text back, but a stop string
            # may already be complete in what comes before it.
            self._find_stop(self.text + new.rstrip("\ufffd"))
            return
        if new:
            self._commit(new)

    def add_all(self, token_ids: list[int]) -> int:
        """Append tokens until a stop string completes; how many were kept (through the one
        that completed it: the rest are cut)."""
        for i, token_id in enumerate(token_ids):
            self.add(token_id)
            if self.stopped:
                return i + 1
        return len(token_ids)

    def take(self, final: bool = False) -> str:
        """Text not yet returned; holds back a possible stop-string prefix unless final."""
        if final and not self.stopped and self._read_offset < len(self._ids):
            self._commit(self._pending())  # an incomplete trailing character, as the tokenizer renders it
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _pending(self) -> str:
        """Text the tokens past _read_offset add (empty if they add none yet)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        return window[len(prefix):] if len(window) > len(prefix) else ""

    def _commit(self, new: str) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._find_stop(self.text + new)
        if not self.stopped:
            self.text += new

    def _find_stop(self, text: str) -> None:
        """Stop at the earliest stop string in `text` that ends past what was checked before."""
        search_from = max(0, len(self.text) - self.holdback)
        hits = [at for at in (text.find(s, search_from) for s in self.stop_strings) if at != -1]
        if hits:
            self.text = text[: min(hits)]
            self.stopped = True
