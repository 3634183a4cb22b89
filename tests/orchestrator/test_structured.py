"""Structured output and log-probabilities through real services (the tiny stack): greedy
output under a grammar is HF `generate()` under the same grammar as a logits processor, at
every k; log-probabilities are the target's own log-softmax; bad grammars get clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tiny import make_tokenizer
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from tandem.grammar import GrammarSpec, token_bytes_tokenizer
from tandem.launch import Stack
from tandem.v1 import common_pb2

# Over the tiny models' characters (a-z, space, . , : ( ) = and newline).
REGEX = r"(yes|no), [a-z]{2,6}( [a-z]{1,5}){0,3}\."
LARK = 'start: "(" NAME (", " NAME)* ")"\nNAME: /[a-z]{1,4}/'
PROMPT = "a grammar: "


class GrammarProcessor(LogitsProcessor):
    """The grammar as transformers applies a logits processor: each step's scores masked to
    what llguidance allows after the tokens generated so far (the reference, apart from
    Tandem's own grammar state)."""

    def __init__(self, matcher: object, start: int, vocab: int) -> None:
        self.matcher, self.start, self.vocab, self.fed = matcher, start, vocab, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.start:].tolist()
        for token in generated[self.fed:]:
            assert self.matcher.consume_token(token)  # type: ignore[attr-defined]
        self.fed = len(generated)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8),  # type: ignore[attr-defined]
                             bitorder="little")[:self.vocab]
        return scores.masked_fill(~torch.from_numpy(bits.astype(bool)), -torch.inf)  # type: ignore[return-value]


def grammar_reference(target: Path, spec: GrammarSpec, prompt: list[int], max_new_tokens: int) -> list[int]:
    import llguidance

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    tokenizer = token_bytes_tokenizer(make_tokenizer(), vocab, [0])
    matcher = llguidance.LLMatcher(tokenizer, spec.source())
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([GrammarProcessor(matcher, len(prompt), vocab)]))
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(0) + 1] if 0 in tokens else tokens


@pytest.mark.parametrize("grammar", [common_pb2.Grammar(regex=REGEX), common_pb2.Grammar(lark=LARK)],
                         ids=["regex", "lark"])
def test_greedy_output_under_a_grammar_is_the_targets_own(tiny_stack: Stack, tiny_target: Path,
                                                          grammar: common_pb2.Grammar) -> None:
    spec = GrammarSpec(grammar.WhichOneof("kind") or "", getattr(grammar, grammar.WhichOneof("kind") or ""))
    prompt = make_tokenizer().encode(PROMPT)
    want = grammar_reference(tiny_target, spec, prompt, 40)
    pattern = REGEX if spec.kind == "regex" else r"\([a-z]{1,4}(, [a-z]{1,4})*\)"
    assert re.fullmatch(pattern, make_tokenizer().decode([t for t in want if t != 0]))
    with tiny_stack.client() as client:
        for k in (0, 1, 4):
            reply = client.generate(prompt, max_new_tokens=40, num_speculative_tokens=k, proposer="draft-model",
                                    grammar=grammar)
            assert list(reply.token_ids) == want, f"k={k}"
            usage = reply.usage
            # Forced tokens cost no pass, in a decode run (k = 0) as between steps: "yes"/"no"
            # then ", " after their first letter; "(" first.
            assert usage.grammar_forced_tokens > 0
            assert usage.target_forward_passes <= usage.completion_tokens - usage.grammar_forced_tokens
            if k:  # speculation ran under the grammar: drafted and accepted besides what was forced
                assert usage.accepted_tokens > usage.grammar_forced_tokens
        for proposer in ("suffix", "prompt-lookup"):
            reply = client.generate(prompt, max_new_tokens=40, num_speculative_tokens=4, proposer=proposer,
                                    grammar=grammar)
            assert list(reply.token_ids) == want, proposer


def test_logprobs_are_the_targets_own_log_softmax(tiny_stack: Stack, tiny_target: Path) -> None:
    prompt = make_tokenizer().encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with tiny_stack.client() as client:
        for k, temperature in ((0, 0.0), (4, 0.0), (4, 1.0)):
            reply = client.generate(prompt, max_new_tokens=24, num_speculative_tokens=k, temperature=temperature,
                                    seed=3, proposer="draft-model", logprobs=5, ignore_eos=True)
            tokens = list(reply.token_ids)
            assert len(reply.logprobs) == len(tokens)
            if k:
                assert reply.usage.accepted_tokens > 0
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            want = torch.log_softmax(logits, -1)
            for i, got in enumerate(reply.logprobs):
                assert got.token_id == tokens[i]
                assert got.logprob == pytest.approx(float(want[i, tokens[i]]), abs=2e-3)
                top = torch.topk(want[i], 5)
                assert list(got.top_logprobs) == pytest.approx(top.values.tolist(), abs=2e-3)
                assert set(got.top_token_ids) == set(top.indices.tolist()) or \
                    len(set(top.values.tolist())) < 5  # ties may order differently


def test_forced_tokens_come_from_a_pass_where_logprobs_are_asked(tiny_stack: Stack) -> None:
    prompt = make_tokenizer().encode(PROMPT)
    with tiny_stack.client() as client:
        reply = client.generate(prompt, max_new_tokens=30, num_speculative_tokens=2, proposer="draft-model",
                                grammar=common_pb2.Grammar(regex=REGEX), logprobs=0)
    assert len(reply.logprobs) == len(reply.token_ids)
    assert all(lp.logprob <= 0.0 for lp in reply.logprobs)
    assert reply.usage.grammar_forced_tokens > 0


@pytest.mark.parametrize("grammar, fields, message", [
    (common_pb2.Grammar(json_schema="{not json"), {}, "grammar.json_schema is not JSON"),
    (common_pb2.Grammar(json_schema='{"type": "strin"}'), {}, "grammar.json_schema"),
    (common_pb2.Grammar(regex="(unclosed"), {}, "grammar.regex"),
    (common_pb2.Grammar(lark="start: undefined_rule"), {}, "grammar.lark"),
    (common_pb2.Grammar(lark="start: " + " | ".join(f'"w{i}"' for i in range(12_000))), {},
     "at most 64000"),  # past the compile limit on a grammar's size
    (common_pb2.Grammar(regex="[a-z]+"), {"ignore_eos": True}, "ignore_eos"),
    (common_pb2.Grammar(regex="[a-z]+"), {"proposer": "lookahead"}, "lookahead"),
], ids=["not-json", "bad-schema", "bad-regex", "bad-lark", "too-large", "ignore-eos", "tree-proposer"])
def test_a_bad_grammar_is_refused_and_the_server_keeps_serving(tiny_stack: Stack, grammar: common_pb2.Grammar,
                                                               fields: dict[str, object], message: str) -> None:
    with tiny_stack.client() as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(PROMPT, max_new_tokens=4, grammar=grammar, **fields)  # type: ignore[arg-type]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()
        assert len(client.generate(PROMPT, max_new_tokens=4).token_ids) >= 1
