"""The rejection sampler: hand-built greedy cases, parameter handling, and exactness in distribution."""

from __future__ import annotations

import math

import pytest
import torch
from laws import p_value, warped_by_transformers
from mutants import mutant

from tandem import sampling
from tandem.sampling import SamplingParams, SparseDistribution

GREEDY = SamplingParams()
ALPHA = 1e-3  # false-alarm rate of every statistical test here (chi-square: tests/laws.py)


def one_hot(token: int, vocab: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def greedy_step(target_argmax: list[int], draft: list[int]) -> list[int]:
    """One greedy verification step, end to end through the core functions."""
    probs = torch.stack([one_hot(t) for t in target_argmax])  # [k+1, vocab]
    dists = [SparseDistribution((t,), (1.0,)) for t in draft]
    scored = sampling.score_block(probs, draft, dists, torch.Generator().manual_seed(0))
    accepted = sampling.num_accepted(scored.target_probs, [1.0] * len(draft), [0.5] * len(draft))
    return sampling.commit(draft, scored, accepted)


def test_greedy_perfect_match_takes_bonus() -> None:
    assert greedy_step([1, 2, 3, 4], [1, 2, 3]) == [1, 2, 3, 4]


def test_greedy_first_token_rejected_is_recovered() -> None:
    assert greedy_step([5, 2, 3, 4], [1, 2, 3]) == [5]


def test_greedy_early_mismatch() -> None:
    assert greedy_step([1, 2, 0, 4], [1, 2, 3]) == [1, 2, 0]


def test_greedy_empty_draft_is_plain_decoding() -> None:
    assert greedy_step([4], []) == [4]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_draft_lengths(k: int) -> None:
    target = list(range(1, k + 2))
    assert greedy_step([t % 6 for t in target], [t % 6 for t in target[:k]]) == [t % 6 for t in target]


def test_probabilities_greedy_is_one_hot_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    assert sampling.probabilities(logits, GREEDY).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_probabilities_temperature_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    full = sampling.probabilities(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(full, torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = sampling.probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # Nucleus 0.7: 0.5 < 0.7, so the second token is kept as well; 0.5 + 0.3 >= 0.7 stops there.
    nucleus = sampling.probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    hot = sampling.probabilities(logits, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2
    assert torch.allclose(hot[0], expected / expected.sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.5, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=12, top_p=0.9),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.5),
], ids=str)
def test_probabilities_agree_with_transformers_warpers(params: SamplingParams) -> None:
    """Every exact law in these tests is built with probabilities(): check it against an
    independent reference, transformers' own warpers, on the same logits."""
    logits = 3.0 * torch.randn(256, 32, generator=torch.Generator().manual_seed(3))
    ours, reference = sampling.probabilities(logits, params), warped_by_transformers(logits, params)
    assert torch.equal(ours > 0, reference > 0), "a different set of tokens was kept"
    assert torch.allclose(ours, reference, atol=1e-6)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(temperature=math.nan), "temperature"),
    (SamplingParams(temperature=math.inf), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
])
def test_validate_names_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        sampling.validate(params)


def test_truncate_renormalises_to_top_support() -> None:
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    ids, kept = sampling.truncate(probs, 2)
    assert ids.tolist() == [1, 3]
    assert torch.allclose(kept, torch.tensor([4 / 7, 3 / 7]))


def test_score_block_does_not_modify_its_inputs() -> None:
    # vLLM PR #16952 modified draft probabilities in place.
    probs = torch.softmax(torch.randn(3, 5), -1)
    before = probs.clone()
    dists = [SparseDistribution((0, 1), (0.5, 0.5)), SparseDistribution((2,), (1.0,))]
    sampling.score_block(probs, [1, 2], dists, torch.Generator().manual_seed(1))
    assert torch.equal(probs, before)


# --- Exactness in distribution -------------------------------------------------------------

VOCAB = 4


def _random_rows(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(2.0 * torch.randn(*shape, VOCAB, generator=generator), -1)


def _two_tokens(accept_rule: object, trials: int, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """Sample the first two tokens with k=2 speculation over fixed random p and q tables.

    The target's p for token 2 depends on token 1 (p2[x1]), as does the draft's q2[x1].
    Returns the observed cell counts over (token1, token2) and the exact target law.
    """
    tables = torch.Generator().manual_seed(1234)
    p1, p2, p3 = _random_rows(tables), _random_rows(tables, VOCAB), _random_rows(tables, VOCAB, VOCAB)
    q1, q2 = _random_rows(tables), _random_rows(tables, VOCAB)
    rng = torch.Generator().manual_seed(seed)
    counts = [0] * (VOCAB * VOCAB)
    for _ in range(trials):
        x1 = int(sampling.sample(q1[None], rng)[0])
        x2 = int(sampling.sample(q2[x1][None], rng)[0])
        drafted = [x1, x2]
        dists = [SparseDistribution(tuple(range(VOCAB)), tuple(q1.tolist())),
                 SparseDistribution(tuple(range(VOCAB)), tuple(q2[x1].tolist()))]
        target = torch.stack([p1, p2[x1], p3[x1, x2]])
        scored = sampling.score_block(target, drafted, dists, rng)
        uniforms = torch.rand(2, generator=rng, dtype=torch.float64).tolist()
        accepted = accept_rule(scored.target_probs, [q1[x1].item(), q2[x1][x2].item()], uniforms)  # type: ignore[operator]
        out = sampling.commit(drafted, scored, accepted)
        if len(out) == 1:  # the next step would be plain target sampling from p2[token1]
            out.append(int(sampling.sample(p2[out[0]][None], rng)[0]))
        counts[out[0] * VOCAB + out[1]] += 1
    exact = (p1[:, None] * p2).reshape(-1)
    return counts, exact


def test_speculative_sampling_matches_target_distribution() -> None:
    counts, exact = _two_tokens(sampling.num_accepted, trials=20_000)
    assert p_value(counts, exact) > ALPHA


@pytest.mark.slow  # a mutant's chi-square run (CI runs it)
def test_statistical_test_catches_a_broken_acceptance_rule() -> None:
    """The test above has power: accepting every drafted token (output ~ q) fails it."""
    counts, exact = _two_tokens(lambda p, q, u: len(p), trials=20_000)
    assert p_value(counts, exact) < ALPHA


@pytest.mark.slow  # a mutant's chi-square run (CI runs it)
def test_statistical_test_catches_a_subtly_wrong_acceptance_rule() -> None:
    """Accepting with probability min(1, p) instead of min(1, p/q) also fails."""
    counts, exact = _two_tokens(lambda p, q, u: sampling.num_accepted(p, [1.0] * len(p), u),
                                trials=20_000)
    assert p_value(counts, exact) < ALPHA


def _three_tokens(trials: int, support: int = VOCAB, sample_from_truncated: bool = True,
                  score: object = sampling.score_block, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """The first three tokens with k=2: every path, the bonus token included, is counted.

    The draft sends its distributions truncated to `support` tokens (what the draft service
    does with max_support_size < vocab). An honest draft samples from what it sends
    (sample_from_truncated); a broken one samples from its full q and sends the truncation.
    """
    tables = torch.Generator().manual_seed(99)
    p1, p2, p3 = _random_rows(tables), _random_rows(tables, VOCAB), _random_rows(tables, VOCAB, VOCAB)
    q1, q2 = _random_rows(tables), _random_rows(tables, VOCAB)
    rng = torch.Generator().manual_seed(seed)

    def draft(q: torch.Tensor) -> tuple[int, SparseDistribution]:
        ids, probs = sampling.truncate(q, support)
        x = (int(ids[sampling.sample(probs[None], rng)[0]]) if sample_from_truncated
             else int(sampling.sample(q[None], rng)[0]))
        return x, SparseDistribution(tuple(ids.tolist()), tuple(probs.tolist()))

    counts = [0] * VOCAB ** 3
    for _ in range(trials):
        x1, d1 = draft(q1)
        x2, d2 = draft(q2[x1])
        target = torch.stack([p1, p2[x1], p3[x1, x2]])
        scored = score(target, [x1, x2], [d1, d2], rng)  # type: ignore[operator]
        q_of = [d.probs[d.token_ids.index(x)] if x in d.token_ids else 0.0 for d, x in ((d1, x1), (d2, x2))]
        uniforms = torch.rand(2, generator=rng, dtype=torch.float64).tolist()
        out = sampling.commit([x1, x2], scored, sampling.num_accepted(scored.target_probs, q_of, uniforms))
        while len(out) < 3:  # the next steps would sample from the target alone
            row = p2[out[0]] if len(out) == 1 else p3[out[0], out[1]]
            out.append(int(sampling.sample(row[None], rng)[0]))
        counts[(out[0] * VOCAB + out[1]) * VOCAB + out[2]] += 1
    exact = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)
    return counts, exact


def test_the_bonus_token_follows_the_target() -> None:
    counts, exact = _three_tokens(trials=20_000)
    assert p_value(counts, exact) > ALPHA


@pytest.mark.slow  # a mutant's chi-square run (CI runs it)
def test_statistical_test_catches_a_bonus_from_the_wrong_position() -> None:
    """Power: the bonus token drawn from the last drafted position's p instead of the next one's."""
    import dataclasses

    def bonus_from_p_k(target, drafted, dists, rng):  # type: ignore[no-untyped-def]
        scored = sampling.score_block(target, drafted, dists, rng)
        return dataclasses.replace(scored, bonus_token_id=int(sampling.sample(target[-2][None], rng)[0]))

    counts, exact = _three_tokens(trials=20_000, score=bonus_from_p_k)
    assert p_value(counts, exact) < ALPHA


def test_a_truncated_draft_distribution_stays_exact() -> None:
    counts, exact = _three_tokens(trials=20_000, support=2)
    assert p_value(counts, exact) > ALPHA


@pytest.mark.slow  # a mutant's chi-square run (CI runs it)
def test_statistical_test_catches_a_draft_that_samples_outside_what_it_sends() -> None:
    counts, exact = _three_tokens(trials=20_000, support=2, sample_from_truncated=False)
    assert p_value(counts, exact) < ALPHA


def test_seeded_sampling_is_deterministic() -> None:
    a, _ = _two_tokens(sampling.num_accepted, trials=300, seed=7)
    b, _ = _two_tokens(sampling.num_accepted, trials=300, seed=7)
    assert a == b


# --- Token trees (deterministic candidates: Medusa, Lookahead) --------------------------------

# A tree rooted after the history: nodes 0 (a) and 1 (b) are the root's children; node 2 (c)
# is a's child.
TREE_TOKENS, TREE_PARENTS = (1, 2, 3), (-1, -1, 0)


def test_verify_tree_greedy_follows_the_argmax_path() -> None:
    # Root argmax is b (node 1), a leaf: kept, then the bonus is b's argmax.
    probs = torch.stack([one_hot(2), one_hot(3), one_hot(5), one_hot(0)])
    verdict = sampling.verify_tree(probs, TREE_TOKENS, TREE_PARENTS, torch.Generator())
    assert verdict.accepted_nodes == (1,) and verdict.next_token_id == 5


def test_verify_tree_greedy_descends_two_levels() -> None:
    probs = torch.stack([one_hot(1), one_hot(3), one_hot(5), one_hot(4)])
    verdict = sampling.verify_tree(probs, TREE_TOKENS, TREE_PARENTS, torch.Generator())
    assert verdict.accepted_nodes == (0, 2) and verdict.next_token_id == 4


def test_verify_tree_greedy_rejects_everything() -> None:
    probs = torch.stack([one_hot(4), one_hot(3), one_hot(5), one_hot(4)])
    verdict = sampling.verify_tree(probs, TREE_TOKENS, TREE_PARENTS, torch.Generator())
    assert verdict.accepted_nodes == () and verdict.next_token_id == 4


def test_verify_tree_empty_tree_is_plain_sampling() -> None:
    verdict = sampling.verify_tree(one_hot(3)[None], (), (), torch.Generator())
    assert verdict == sampling.TreeVerdict((), 3)


def _tree_two_tokens(trials: int, verify: object = sampling.verify_tree) -> tuple[list[int], torch.Tensor]:
    """First two tokens when every step verifies a fixed two-level tree over random p tables.

    Candidates: the two tokens 0 and 1 at the root, and token 2 under each, so a node has
    siblings to try after a rejection and a path can end below the root.
    """
    tables = torch.Generator().manual_seed(99)
    p1, p2, p3 = _random_rows(tables), _random_rows(tables, VOCAB), _random_rows(tables, VOCAB, VOCAB)
    tokens, parents = (0, 1, 2, 2), (-1, -1, 0, 1)
    rng = torch.Generator().manual_seed(5)
    counts = [0] * (VOCAB * VOCAB)
    for _ in range(trials):
        probs = torch.stack([p1, p2[0], p2[1], p3[0, 2], p3[1, 2]])
        verdict = verify(probs, tokens, parents, rng)  # type: ignore[operator]
        out = [tokens[n] for n in verdict.accepted_nodes] + [verdict.next_token_id]
        if len(out) == 1:  # the next step starts a new tree after token 1; its first token ~ p2
            out.append(int(sampling.sample(p2[out[0]][None], rng)[0]))
        counts[out[0] * VOCAB + out[1]] += 1
    return counts, (p1[:, None] * p2).reshape(-1)


def test_tree_verification_matches_target_distribution() -> None:
    counts, exact = _tree_two_tokens(trials=20_000)
    assert p_value(counts, exact) > ALPHA


@pytest.mark.slow  # a mutant's chi-square run (CI runs it)
def test_tree_statistical_test_catches_always_keeping_the_first_candidate() -> None:
    def keep_first(probs, tokens, parents, rng):  # type: ignore[no-untyped-def]
        return sampling.TreeVerdict((0,), int(sampling.sample(probs[1][None], rng)[0]))

    counts, exact = _tree_two_tokens(trials=20_000, verify=keep_first)
    assert p_value(counts, exact) < ALPHA


# Mutants of verify_tree itself, each one line of its walk broken (tests/mutants.py).
TREE_MUTANTS = {
    # A rejected candidate keeps its mass: a later sibling is kept too rarely, and the
    # emitted token can be a candidate that was just rejected.
    "no-zeroing": ("residual[token] = 0.0", "pass"),
    # u ~ U[0, 1) against r(c) without dividing by sum(r): once a sibling was rejected, the
    # next is kept with probability r(c), not r(c) / sum(r).
    "unnormalised-uniforms": ("u * mass < chosen", "u < chosen"),
    # The token after the path drawn from p, not from the residual: a rejected candidate
    # can be emitted after all.
    "recovered-from-p": ("sample(residual[None], generator)",
                         "sample(target_probs[row][None], generator)"),
}


@pytest.mark.slow  # a mutant's chi-square run (CI runs it)
@pytest.mark.parametrize("edit", TREE_MUTANTS.values(), ids=TREE_MUTANTS.keys())
def test_tree_statistical_test_catches_a_broken_verify_tree(edit: tuple[str, str]) -> None:
    counts, exact = _tree_two_tokens(trials=20_000, verify=mutant(sampling.verify_tree, *edit))
    assert p_value(counts, exact) < ALPHA


@pytest.mark.parametrize("temperature", [1.401298464324817e-45, 1e-30, 1e-8])
def test_a_tiny_temperature_is_nearly_greedy_not_nan(temperature: float) -> None:
    """Found by the GenerateRequest fuzzer: logits / 1e-45 overflowed to inf, softmax to NaN."""
    logits = torch.tensor([[3.0, 9.0, -2.0, 8.5]])
    probs = sampling.probabilities(logits, SamplingParams(temperature=temperature))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("vocab", [151_936, 151_937, 1_100, 37])
def test_argmax_by_blocks_is_torchs_argmax(vocab: int) -> None:
    """The lowest id among ties, a maximum in the tail past the last whole block, NaN rows."""
    torch.manual_seed(vocab)
    for trial in range(60):
        logits = torch.randint(-3, 3, (5, vocab)).float() if trial % 2 else torch.randn(5, vocab)
        if trial % 5 == 0:
            logits[trial % 5, -1] = 10.0  # the maximum in the tail
        if trial % 7 == 0:
            logits[1, (trial * 13) % vocab] = float("nan")
        assert torch.equal(sampling.argmax(logits), logits.argmax(-1)), trial


def _top_p_by_sorting(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule as written: sort the whole row, drop a token once the mass before it reaches top_p."""
    probs = torch.softmax(logits, -1)
    ranked, order = torch.sort(probs, dim=-1, descending=True)
    ranked = ranked.masked_fill(torch.cumsum(ranked, -1) - ranked >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, ranked)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, 5.0, 30.0])  # from flat (thousands kept) to peaked
@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.99])
def test_top_p_over_the_most_likely_tokens_is_the_rule_over_the_sorted_row(scale: float, top_p: float) -> None:
    torch.manual_seed(int(scale * 100))
    logits = torch.randn(4, 20_000) * scale
    got = sampling.probabilities(logits, sampling.SamplingParams(temperature=1.0, top_p=top_p))
    want = _top_p_by_sorting(logits, top_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-7)


def test_sample_never_draws_a_token_without_mass() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [1e-30, 0.0, 0.0, 0.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    seen = torch.stack([sampling.sample(probs, generator) for _ in range(4000)])
    assert set(seen[:, 0].tolist()) == {1, 3} and set(seen[:, 1].tolist()) == {0}
    share = float((seen[:, 0] == 3).double().mean())
    assert abs(share - 0.75) < 0.03


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_scores_from_the_argmax_are_the_one_hot_rules(k: int) -> None:
    """score_logits' greedy shortcut gives what score_block gives on the one-hot rows."""
    torch.manual_seed(k)
    greedy = sampling.SamplingParams()
    for trial in range(30):
        logits = torch.randint(-2, 2, (k + 1, 50)).float()  # many ties: the lowest id wins
        best = logits.argmax(-1).tolist()
        drafted = [best[i] if (trial + i) % 2 else (best[i] + 1) % 50 for i in range(k)]
        dists = [sampling.SparseDistribution((t,), (1.0,)) for t in drafted]
        want = sampling.score_block(sampling.probabilities(logits, greedy), drafted, dists,
                                    torch.Generator().manual_seed(trial))
        assert sampling.score_logits(logits, greedy, drafted, dists, trial) == want


@pytest.mark.parametrize("vocab", [151_936, 151_937, 2_048, 37])
def test_top_tokens_are_the_most_likely_in_order(vocab: int) -> None:
    torch.manual_seed(vocab)
    for trial in range(40):
        logits = torch.randn(vocab) * (1 + trial % 4)
        got = sampling.top_tokens(logits, 4)
        assert logits[got].tolist() == torch.topk(logits, min(4, vocab)).values.tolist()


TOP_P = 0.6


def _top_p_set_of(size: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Logits [vocab] whose top-p set at TOP_P is exactly the `size` most likely tokens: they
    have near-equal shares a, and TOP_P sits half a share past size - 1 of them."""
    share = TOP_P / (size - 0.5)
    probs = torch.full((vocab,), (1 - size * share) / (vocab - size), dtype=torch.float64)
    probs[:size] = share * (1 + 1e-4 * torch.linspace(1, 0, size, dtype=torch.float64))  # no ties
    return probs[torch.randperm(vocab, generator=generator)].log().float()


@pytest.mark.parametrize("sizes", [(2, 200), (64, 65), (1024, 1025), (65, 1025), (3, 64)],
                         ids=lambda s: f"{s[0]}+{s[1]}")
def test_top_p_keeps_each_rows_own_set_in_a_mixed_batch(sizes: tuple[int, int]) -> None:
    """Rows of one batch whose top-p sets end on either side of a rung of the search (64, 1024
    tokens): each row keeps exactly its own set, whatever the other row needs (a search that
    stops when any row has its mass, or a token early at a rung, keeps too few)."""
    generator = torch.Generator().manual_seed(sum(sizes))
    logits = torch.stack([_top_p_set_of(size, 4096, generator) for size in sizes])
    got = sampling.probabilities(logits, sampling.SamplingParams(temperature=1.0, top_p=TOP_P))
    assert [int((row > 0).sum()) for row in got] == list(sizes)
    assert torch.allclose(got, _top_p_by_sorting(logits, TOP_P), atol=1e-7)
