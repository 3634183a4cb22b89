"""Sampled output through the three services follows the target-only distribution.

A 4-token vocabulary makes the exact law of the first three generated tokens
computable (64 cells). The orchestrator's first step is the target alone (it
prefills both caches), so speculation decides tokens 2 and 3: each request asks for 4
tokens, so the second step may draft k=2 (a block never runs past what can be committed,
and with 3 tokens it would be capped at 1); Medusa verifies the heads' 14-node tree. Chi-square test, false-alarm rate ALPHA; the core test
(tests/tandem/test_sampling.py) shows the same test fails for broken acceptance rules.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from scipy import stats
from tiny import make_draft_like, make_medusa_heads, make_model
from transformers import AutoModelForCausalLM

from tandem import sampling
from tandem.launch import Stack, start_stack

ALPHA = 1e-3
SAMPLES = 3000
PROMPT = [2, 3, 2]
VOCAB = 4


@pytest.fixture(scope="module")
def small_vocab(tiny_dir: Path) -> Iterator[tuple[Path, Stack]]:
    target = make_model(tiny_dir / "v4-target", seed=11, chars="ab", init_std=0.5)
    draft = make_draft_like(target, tiny_dir / "v4-draft", noise=0.5, seed=12)
    # Heads trained on the target's sampled text: the tree holds likely and unlikely tokens.
    heads = make_medusa_heads(target, tiny_dir / "v4-medusa", temperature=1.0, num_prompts=128,
                              epochs=2)
    # min n-gram 1: prompt lookup proposes from a single matching token, so it proposes often.
    # Lookahead N=3: its pool is first harvested after the second pass, so it verifies token 3.
    stack = start_stack(str(draft), str(target),
                        target_args=["--lookahead", "4,3,4", "--medusa-heads", str(heads)],
                        orchestrator_args=["--prompt-lookup-min-ngram", "1"])
    yield target, stack
    stack.stop()


def exact_law(target: Path, params: sampling.SamplingParams) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    law = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    with torch.inference_mode():
        for t1, t2 in itertools.product(range(VOCAB), repeat=2):
            logits = model(torch.tensor([PROMPT + [t1, t2]])).logits[0, -3:]
            p = sampling.probabilities(logits, params).double()
            law[t1, t2] = p[0, t1] * p[1, t2] * p[2]
    return law.reshape(-1)


T1 = sampling.SamplingParams(temperature=1.0)
TRUNCATED = sampling.SamplingParams(temperature=0.8, top_k=3, top_p=0.9)


@pytest.mark.parametrize("params, proposer", [
    *((params, proposer) for proposer in ("draft-model", "prompt-lookup", "lookahead")
      for params in (T1, TRUNCATED)),
    # NOTE: Medusa in one setting only: each costs ~40 s of requests through real processes;
    # the tree rule itself is tested against exact laws in tests/tandem/test_sampling.py.
    (T1, "medusa"),
], ids=lambda v: v if isinstance(v, str) else "t1" if v == T1 else "t0.8-topk3-topp0.9")
def test_speculative_sampling_matches_target_law(small_vocab: tuple[Path, Stack],
                                                 params: sampling.SamplingParams, proposer: str) -> None:
    target, stack = small_vocab
    law = exact_law(target, params)
    with stack.client() as client:
        def draw(seed: int) -> tuple[int, int]:
            reply = client.generate(PROMPT, max_new_tokens=4, temperature=params.temperature,
                                    top_k=params.top_k, top_p=params.top_p, seed=seed,
                                    num_speculative_tokens=2, proposer=proposer, ignore_eos=True)
            t = list(reply.token_ids)
            usage = reply.usage
            return t[0] * VOCAB * VOCAB + t[1] * VOCAB + t[2], usage.accepted_tokens, usage.drafted_tokens

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(draw, range(SAMPLES)))
    accepted, drafted = sum(r[1] for r in results), sum(r[2] for r in results)
    assert 0 < accepted <= drafted
    if proposer == "draft-model":
        assert drafted >= 2 * SAMPLES  # every request's second step verified a 2-token block
    if params.top_p == 1.0:
        # Speculation really accepted and rejected tokens. (Under top-p 0.9 this tiny model's
        # law is often one-hot where prompt lookup finds a match, so it may accept them all.)
        assert accepted < drafted
    counts = torch.bincount(torch.tensor([r[0] for r in results]), minlength=VOCAB**3).double()
    expected = law * SAMPLES
    # Pool the cells expected below 5 so the chi-square approximation holds.
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    wanted = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = wanted > 0
    assert observed[~keep].sum() == 0, "a token outside the target's support was sampled"
    wanted = wanted[keep] * (observed.sum() / wanted[keep].sum())
    p_value = stats.chisquare(observed[keep].tolist(), wanted.tolist()).pvalue
    assert p_value > ALPHA
