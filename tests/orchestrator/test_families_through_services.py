"""The draft-model proposer and Medusa through real processes on other model families.

The rest of the suite serves Llama-shaped models. Here a Qwen2 pair (with Medusa heads on
its target) and a Mistral pair whose sliding window (8 tokens) is far shorter than the text:
every step's rollback and every scored block lies past the window. Greedy output equals the
target's own generate().
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny import (
    PROMPTS,
    greedy_reference,
    make_medusa_heads,
    make_tokenizer,
    noisy_copy,
    save_family,
)
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tandem.launch import Stack, start_stack
from tandem.v1 import common_pb2

LENGTH = 40
SLIDING_WINDOW = 8

pytestmark = pytest.mark.slow  # stacks of its own, per family (CI runs it)


@pytest.fixture(scope="module")
def qwen2(tiny_dir: Path) -> Iterator[tuple[Path, Stack]]:
    target = save_family(tiny_dir / "qwen2-target", Qwen2ForCausalLM, Qwen2Config, seed=31)
    draft = noisy_copy(target, tiny_dir / "qwen2-draft", seed=32)
    heads = make_medusa_heads(target, tiny_dir / "qwen2-medusa")
    stack = start_stack(str(draft), str(target), target_args=["--medusa-heads", str(heads)])
    yield target, stack
    stack.stop()


@pytest.fixture(scope="module")
def mistral(tiny_dir: Path) -> Iterator[tuple[Path, Stack]]:
    target = save_family(tiny_dir / "mistral-target", MistralForCausalLM, MistralConfig, seed=41,
                         sliding_window=SLIDING_WINDOW)
    draft = noisy_copy(target, tiny_dir / "mistral-draft", seed=42)
    stack = start_stack(str(draft), str(target))
    yield target, stack
    stack.stop()


def check_greedy(target: Path, stack: Stack, prompt: str, **kwargs: object) -> common_pb2.Proposer:
    # Token ids, not text: AutoTokenizer gives a qwen2 model its own tokenizer class, which
    # pre-tokenizes text its way (it drops this character vocabulary's spaces).
    ids = make_tokenizer().encode(prompt)
    expected = greedy_reference(target, ids, LENGTH)
    assert len(set(expected)) >= 4, f"a degenerate reference proves little: {expected}"
    with stack.client() as client:
        reply = client.generate(ids, max_new_tokens=LENGTH, ignore_eos=True, **kwargs)  # type: ignore[arg-type]
    assert list(reply.token_ids) == expected
    usage = reply.usage
    assert usage.drafted_tokens > 0 and 0 < usage.accepted_tokens <= usage.drafted_tokens
    return usage.proposer


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_qwen2_draft_model(qwen2: tuple[Path, Stack], prompt: str, k: int) -> None:
    assert check_greedy(*qwen2, prompt, num_speculative_tokens=k) == common_pb2.PROPOSER_DRAFT_MODEL


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_qwen2_medusa(qwen2: tuple[Path, Stack], prompt: str) -> None:
    assert check_greedy(*qwen2, prompt, proposer="medusa") == common_pb2.PROPOSER_MEDUSA


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_mistral_draft_model_past_the_sliding_window(mistral: tuple[Path, Stack], prompt: str, k: int) -> None:
    target, _ = mistral
    config = AutoModelForCausalLM.from_pretrained(target).config
    assert config.sliding_window == SLIDING_WINDOW < len(prompt) + LENGTH
    assert check_greedy(*mistral, prompt, num_speculative_tokens=k) == common_pb2.PROPOSER_DRAFT_MODEL
