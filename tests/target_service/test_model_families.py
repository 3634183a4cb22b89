"""Target proposers on model families whose attention or positions differ from Llama's.

A target proposer scores its segment with a hand-built mask at positions past the history.
That is exact only where the model's own pass would see the same thing: inside a sliding
window, inside the positions the model has, and where the rotary frequencies do not depend
on a pass's last position. Each case: greedy output through Lookahead equals generate().
"""

from __future__ import annotations

import pytest
import torch
from tiny import verify_directly
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from tandem import models, sampling
from tandem.kv import KVSession
from tandem.model_service import Step
from target_service.lookahead import LookaheadConfig, LookaheadProposer

VOCAB = 40
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.3}


def through_lookahead(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    proposer, session = LookaheadProposer(LookaheadConfig(5, 3, 5)), KVSession("s", VOCAB)
    history, synced = list(prompt), 0
    while len(history) < len(prompt) + n:
        verified = verify_directly(model, session, Step(synced, history[synced:]), proposer,
                                   sampling.SamplingParams(), 0)
        synced = verified.cache_length
        history += verified.committed_token_ids
    return history[len(prompt):len(prompt) + n]


def generated(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def varied(tokens: list[int]) -> bool:
    """Output worth comparing: a model with flat logits repeats one token, which any pass
    reproduces, so each model here is peaky (initializer_range 0.3) and its output varied."""
    return len(set(tokens)) >= 4


def prompts(count: int, length: int) -> list[list[int]]:
    return [torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(s)).tolist()
            for s in range(count)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_sliding_window_attention_past_the_window(attn: str) -> None:
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**SMALL, max_position_embeddings=256,
                                             sliding_window=8, attn_implementation=attn)).eval()
    assert models.sliding_window(model) == 8
    for prompt in prompts(4, 6):
        expected = generated(model, prompt, 30)
        assert varied(expected), expected
        assert through_lookahead(model, prompt, 30) == expected


def test_learned_positions_up_to_the_last_one() -> None:
    """GPT-2's position table ends at n_positions: a window past it raised IndexError."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2,
                                       n_head=4, initializer_range=0.3)).eval()
    assert models.max_context_tokens(model) == 24
    for prompt in prompts(3, 8):
        expected = generated(model, prompt, 16)
        assert varied(expected), expected
        assert through_lookahead(model, prompt, 16) == expected


def test_dynamic_rope_inside_the_context() -> None:
    """Dynamic NTK rescales every position of a pass that reaches past max_position_embeddings."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, max_position_embeddings=24, rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})).eval()
    for prompt in prompts(4, 8):
        expected = generated(model, prompt, 16)
        assert varied(expected), expected
        assert through_lookahead(model, prompt, 16) == expected


def test_longrope_is_served_up_to_its_original_context() -> None:
    """Longrope switches a whole pass to its long factors once the pass's last position is past
    the original context, so multi-token passes are exact only before it: that is the context
    the target reports (and the orchestrator enforces)."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
        "long_factor": [8.0] * 4, "original_max_position_embeddings": 16})).eval()
    assert models.max_context_tokens(model) == 16
    for prompt in prompts(4, 6):
        expected = generated(model, prompt, 10)
        assert varied(expected), expected
        assert through_lookahead(model, prompt, 10) == expected
