"""Structured output: a grammar the generated tokens must follow, and its state after a history.

Under a grammar the target's law at each position is its distribution masked to the tokens
the grammar allows after the tokens before it, and renormalised (what HF `generate()` with
the grammar as a logits processor samples). Speculation keeps that law when the target
masks every row of a block with the mask of the state after the drafted tokens before the
row: a drafted token the grammar forbids then has p = 0 and is rejected, and the recovered
token is drawn from the masked residual. A token the grammar forces (the mask allows it
alone) has p = 1 whatever the logits, so it needs no model to be known.

Masks come from llguidance (an Earley parser over the tokenizer's byte trie; tens of
microseconds a mask at a 152k vocabulary). A `GrammarState` is soft state: the grammar's
matcher after a history, brought to any other history by rolling back to the common prefix
and consuming the rest, so each tier keeps its own beside its cache and rebuilds it from the
history it is sent.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from tandem.errors import InvalidRequest
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

#: The kinds of grammar a request may name (HTTP response_format / guided_* fields, the
#: gRPC Grammar oneof).
KINDS = ("json_schema", "json_object", "regex", "lark")

# JSON is written as Python's json.dumps writes it (", " and ": "), the spacing models were
# trained on; whitespace elsewhere is not free, so the grammar forces the separators.
_JSON_OPTIONS: Any = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
#: The most characters of grammar text a request may send.
MAX_GRAMMAR_CHARS = 64_000
# llguidance's work limits: building a grammar's lexer (about 50k units a millisecond, so at
# most about 40 ms) and each mask (about 14k a millisecond); a grammar past them is refused.
LIMITS: dict[str, Any] = {"initial_lexer_fuel": 2_000_000, "step_lexer_fuel": 400_000, "max_grammar_size": 500_000}
# Compiled grammars kept per process, by their text.
CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a request names it: its kind and its text (json_object has none)."""

    kind: str
    text: str = ""
    label: str = dataclasses.field(default="", compare=False)  # how the request named it, for errors

    def source(self) -> str:
        """llguidance's grammar for it (InvalidRequest naming the field where it is no grammar)."""
        if self.kind not in KINDS:
            raise InvalidRequest(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{self.field} holds {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS))
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{self.field} is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"{self.field} must be a JSON object (a JSON schema)")
            return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS))
        if self.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.text))
        return str(llguidance.LLMatcher.grammar_from_lark(self.text))

    @property
    def field(self) -> str:
        """What the request called it, for errors (the HTTP front end names its own fields)."""
        return self.label or f"grammar.{self.kind}"


def token_bytes_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a tokenizer: the bytes of every token. A fast tokenizer with a
    byte-level or SentencePiece decoder is read as it is; any other from each id's decoded
    text (a character tokenizer's tokens are their text)."""
    eos = list(eos_token_ids) or None
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError as exc:
        log.info("grammar: reading the tokenizer's tokens one by one (%s)", exc)

    special = set(getattr(tokenizer, "all_special_ids", ()))

    class Tokens:
        def __init__(self) -> None:
            self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
            self.bos_token_id = None
            self.tokens = [b"" if i in special or i >= len(tokenizer) else tokenizer.decode([i]).encode()
                           for i in range(vocab_size)]
            self.special_token_ids = sorted(i for i in special if i < vocab_size)

        def __call__(self, text: bytes | str) -> list[int]:
            text = text.decode() if isinstance(text, bytes) else text
            return list(tokenizer.encode(text, add_special_tokens=False))

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), n_vocab=vocab_size, eos_token=eos)


class Grammars:
    """A process's grammars over one tokenizer: each compiled once (by its text) and copied for
    every state. The tokenizer's byte view takes a second or two to build: on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer, self._eos = tokenizer, tuple(eos_token_ids)
        self._view: Any = None
        self._compiled: collections.OrderedDict[GrammarSpec, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # the event loop and the forward worker both start states

    def _llg_tokenizer(self) -> Any:
        if self._view is None:
            self._view = token_bytes_tokenizer(self._tokenizer, self.vocab_size, self._eos)
        return self._view

    def warm(self) -> None:
        """Build the tokenizer's byte view now (a service's start-up), not at the first grammar."""
        with self._lock:
            self._llg_tokenizer()

    def compile(self, spec: GrammarSpec) -> Any:
        """A fresh matcher of `spec` (InvalidRequest where it is no grammar, or past LIMITS)."""
        with self._lock:
            matcher: Any = self._compiled.get(spec)
            if matcher is None:
                source = spec.source()
                limits = llguidance.LLParserLimits(**LIMITS)
                error = llguidance.LLMatcher.validate_grammar(source, self._llg_tokenizer(), limits=limits)
                if not error:
                    matcher = llguidance.LLMatcher(self._llg_tokenizer(), source, log_level=0, limits=limits)
                    error = matcher.get_error() if matcher.is_error() else ""
                if error:
                    over = any(word in error.lower() for word in ("limit", "fuel", "too large", "too big"))
                    raise InvalidRequest(f"{spec.field}: {error.strip()[:400]}"
                                         + (f" (the limits: {LIMITS})" if over else ""))
                self._compiled[spec] = matcher
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec)
            return matcher.deep_copy()

    def state(self, spec: GrammarSpec, start: int) -> GrammarState:
        return GrammarState(spec, start, self.compile(spec), self.vocab_size, frozenset(self._eos))


class GrammarState:
    """A grammar's matcher after a history whose generated tokens begin at `start` (the
    grammar reads only those).

    Kept with a session (tandem.kv.States) but not cut with its cache: a pass cuts the cache to
    where it appends, while the state stands where the step's tokens end (the block being
    drafted, a decode run's last draw). Each step brings it to its own history (`follow`)."""

    def __init__(self, spec: GrammarSpec, start: int, matcher: Any, vocab_size: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.spec, self.start, self.vocab_size = spec, start, vocab_size
        self._matcher, self._eos = matcher, eos_token_ids
        self.consumed: list[int] = []  # the generated tokens the matcher has taken, in order
        # The last consumed token is an end-of-sequence one the grammar allowed: the matcher
        # does not take it in (it only lets it through where the grammar may end).
        self._ended = False
        # The last mask computed, by the generated tokens it follows: the loop, a target's run
        # and a draft ask for the same state's mask more than once.
        self._mask: tuple[tuple[int, ...], torch.Tensor] | None = None

    def rollback(self, position: int) -> bool:
        return True  # see the class docstring: `follow` brings it where a step needs it

    def _cut(self, keep: int) -> None:
        """Roll the matcher back to its first `keep` generated tokens."""
        if keep < len(self.consumed) and self._ended:
            self.consumed.pop()
            self._ended = False
        if keep < len(self.consumed):
            self._matcher.rollback(len(self.consumed) - keep)
            del self.consumed[keep:]

    def follow(self, history: Sequence[int]) -> int:
        """Bring the matcher to `history` (prompt included); returns how many of its generated
        tokens the grammar allows in a row (all of them: len(history) - start)."""
        generated = history[self.start:]
        common = 0
        for a, b in zip(self.consumed, generated):
            if a != b:
                break
            common += 1
        self._cut(common)
        return common + self._consume(list(generated[common:]))

    def take(self, token: int) -> bool:
        """Consume one more generated token; whether the grammar allowed it."""
        return self._consume([token]) == 1

    def _consume(self, tokens: list[int]) -> int:
        """Take as many of `tokens` as the grammar allows in a row; how many it took."""
        if not tokens or self._ended or self._matcher.is_error():
            return 0
        taken = int(self._matcher.try_consume_tokens(tokens))
        self.consumed.extend(tokens[:taken])
        if taken < len(tokens) and tokens[taken] in self._eos and bool(self.allowed()[tokens[taken]]):
            self.consumed.append(tokens[taken])
            self._ended = True
            taken += 1
        return taken

    @property
    def failed(self) -> str:
        """Why the matcher can go no further ("": it can)."""
        return str(self._matcher.get_error()) if self._matcher.is_error() else ""

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab] (none where the matcher failed).
        Shared with later calls at the same state: read it, do not write to it."""
        if self._ended or self._matcher.is_error():
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        key = tuple(self.consumed)
        if self._mask is not None and self._mask[0] == key:
            return self._mask[1]
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.from_numpy(bits[:self.vocab_size].astype(bool))
        if not self._matcher.is_error():
            self._mask = (key, mask)
        return mask

    def masks(self, block: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The masks of the rows that score `block` after the matcher's history: row i allows
        what the grammar allows after block[:i] (bool [len(block) + 1, vocab]); and how many of
        the block's tokens the grammar allows in a row. Rows past the first forbidden token
        are never read (that token has p = 0 and is rejected): they repeat the last mask.
        The matcher ends where it began."""
        rows = [self.allowed()]
        valid = 0
        for token in block:
            if not bool(rows[-1][token]) or not self._consume([token]):
                break
            valid += 1
            rows.append(self.allowed())
        self._cut(len(self.consumed) - valid)
        rows.extend(rows[-1:] * (len(block) + 1 - len(rows)))
        return torch.stack(rows), valid

    def forced(self, most: int) -> list[int]:
        """The tokens the grammar forces next, one after another (each the only token its mask
        allows), at most `most`. The matcher ends where it began."""
        tokens: list[int] = []
        while len(tokens) < most:
            allowed = self.allowed()
            if int(allowed.sum()) != 1:
                break
            token = int(allowed.nonzero()[0, 0])
            if not self._consume([token]):
                break
            tokens.append(token)
        self._cut(len(self.consumed) - len(tokens))
        return tokens

    def admits(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in a row, the grammar allows after the matcher's history."""
        taken = self._consume(list(tokens))
        self._cut(len(self.consumed) - taken)
        return taken


def spec_from(proto: common_pb2.Grammar) -> GrammarSpec | None:
    """The request's grammar (None: it sets none)."""
    kind = proto.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not proto.json_object:
            raise InvalidRequest("grammar.json_object must be true where it is set")
        return GrammarSpec(kind)
    return GrammarSpec(kind, str(getattr(proto, kind)))


def spec_to(spec: GrammarSpec | None) -> common_pb2.Grammar:
    if spec is None:
        return common_pb2.Grammar()
    if spec.kind == "json_object":
        return common_pb2.Grammar(json_object=True)
    fields: dict[str, Any] = {spec.kind: spec.text}
    return common_pb2.Grammar(**fields)
