"""What a step costs besides the forwards, as the services report it: every pass's stages,
the bytes it reads from the device to the host, the orchestrator's own time and the wire's.

The model has the real pair's 152k-token vocabulary, so a pass that read a whole row of
logits to the host would show 600 KB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny import greedy_reference, make_draft_like, make_model, make_tokenizer

from tandem.launch import Stack, start_stack

VOCAB = 151_936
ROW_BYTES = 4 * VOCAB  # one float32 row of logits


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("wide")
    target = make_model(root / "target", seed=1, vocab_size=VOCAB)
    return make_draft_like(target, root / "draft", noise=0.05, seed=2), target


@pytest.fixture(scope="module")
def wide_stack(wide: tuple[Path, Path]) -> Iterator[Stack]:
    draft, target = wide
    stack = start_stack(str(draft), str(target))
    yield stack
    stack.stop()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 3},
                                      {"temperature": 0.8, "top_k": 20, "seed": 4}],
                         ids=["greedy", "top-p", "top-k"])
def test_no_pass_reads_a_vocabulary_row_to_the_host(wide_stack: Stack, sampling: dict[str, float]) -> None:
    usage = wide_stack.client().generate("def fib(n):", max_new_tokens=12, num_speculative_tokens=3,
                                         ignore_eos=True, **sampling).usage  # type: ignore[arg-type]
    decode_steps = usage.target_forward_passes - 1
    target, draft = usage.target_passes, usage.draft_passes
    assert target.pass_count >= decode_steps >= 1
    assert draft.pass_count >= 1
    for split in (target, draft):
        # What crosses per pass: a few drafted tokens' probabilities, the draws, a support of
        # at most 8 tokens, the draft's 4 ranked tokens; never a row of the vocabulary.
        assert 0 < split.host_bytes / split.pass_count < ROW_BYTES / 100
        assert split.forward_ms > 0 and split.host_before_ms > 0 and split.host_after_ms > 0
    assert usage.orchestrator_ms > 0 and usage.replica_wire_ms > 0


def test_the_wide_stack_still_decodes_the_targets_greedy_output(wide_stack: Stack, wide: tuple[Path, Path]) -> None:
    """Sampling on the device, the argmax by blocks: greedy output is still generate()'s."""
    _, target = wide
    prompt = make_tokenizer().encode("x = (a, b)\n")
    want = greedy_reference(target, prompt, 16)
    for k in (0, 4):
        got = wide_stack.client().generate(prompt, max_new_tokens=16, num_speculative_tokens=k,
                                           ignore_eos=True)
        assert list(got.token_ids) == want, k
