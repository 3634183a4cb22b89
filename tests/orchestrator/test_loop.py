"""The real speculation loop (`speculate`, with the real draft proposer and remote sessions)
against in-memory draft and target tables: no services, no models, so a loop-level bug fails
`make test-fast`.

The tables are bigram laws over a 5-token vocabulary (the next token's distribution given
the last one). The in-memory replicas answer the real request protos the sessions build,
holding their caches as token lists, so what the loop sends (cache positions, new tokens) is
checked as well as what it commits.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
import torch
from laws import ALPHA, p_value
from mutants import mutant

from orchestrator import speculation
from orchestrator.domain import Generation, Step
from orchestrator.policy import CostModel
from orchestrator.proposers import DraftModelProposer
from orchestrator.remote import DraftSession, TargetSession
from tandem import sampling
from tandem.v1 import common_pb2, draft_pb2, target_pb2

VOCAB = 5
PROMPT = (1, 2)
NEW_TOKENS = 4  # the law is over the first three: the prefill's token, then a block of K
K = 2


def table(seed: int) -> torch.Tensor:
    """[VOCAB, VOCAB]: row t is the next token's law after t (peaked, as a model's are)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(VOCAB, VOCAB, generator=gen, dtype=torch.float64), -1)


TARGET = table(0)
DRAFT = 0.5 * TARGET + 0.5 * table(1)  # close, not equal: some rejections


def row(law: torch.Tensor, context: list[int]) -> torch.Tensor:
    return law[context[-1]].float()


class TableDraft(DraftSession):
    """A draft replica in memory: rolls back to the request's cache position, draws each token
    from its table with a position-keyed generator, and holds what it fed itself."""

    def __init__(self, law: torch.Tensor) -> None:
        super().__init__(pool=None, session_id="draft", deadline=None)  # type: ignore[arg-type]
        self.law, self.cache, self.positions = law, [], []  # type: ignore[var-annotated]

    async def _step(self, method: str, build: Any) -> Any:
        request: draft_pb2.ProposeBlocksRequest = build(self.synced)
        self.positions.append(request.cache_position)
        assert request.cache_position <= len(self.cache)
        self.cache = self.cache[:request.cache_position] + list(request.new_token_ids)
        tokens, dists = [], []
        for i in range(request.num_speculative_tokens):
            context = self.cache + tokens
            gen = torch.Generator().manual_seed(request.seed * 1000 + len(context))
            probs = row(self.law, context)
            token = int(torch.multinomial(probs, 1, generator=gen))
            tokens.append(token)
            dists.append(common_pb2.SparseDistribution(token_ids=range(VOCAB), probs=probs.tolist()))
        self.cache += tokens[:-1]  # the last drafted token is not fed until it is history
        return draft_pb2.ProposeBlocksResponse(token_ids=tokens, distributions=dists,
                                               cache_length=len(self.cache), compute_ms=1.0)


class TableTarget(TargetSession):
    """A target replica in memory: scores a drafted block against its table."""

    def __init__(self, law: torch.Tensor, greedy: bool = False) -> None:
        super().__init__(pool=None, session_id="target", deadline=None)  # type: ignore[arg-type]
        self.law, self.greedy, self.cache, self.positions = law, greedy, [], []  # type: ignore[var-annotated]

    async def _step(self, method: str, build: Any) -> Any:
        request: target_pb2.ScoreBlocksRequest = build(self.synced)
        self.positions.append(request.cache_position)
        assert request.cache_position <= len(self.cache)
        self.cache = self.cache[:request.cache_position] + list(request.new_token_ids)
        drafted = list(request.draft_proposal.token_ids)
        dists = [sampling.SparseDistribution(tuple(d.token_ids), tuple(d.probs))
                 for d in request.draft_proposal.distributions]
        probs = torch.stack([row(self.law, self.cache + drafted[:i]) for i in range(len(drafted) + 1)])
        if self.greedy:
            probs = torch.nn.functional.one_hot(probs.argmax(-1), VOCAB).float()
        scored = sampling.score_block(probs, drafted, dists, torch.Generator().manual_seed(request.seed))
        self.cache += drafted
        return target_pb2.ScoreBlocksResponse(
            cache_length=len(self.cache), compute_ms=1.0,
            block_scores=target_pb2.BlockScores(target_probs=scored.target_probs,
                                                recovered_token_ids=scored.recovered_token_ids,
                                                bonus_token_id=scored.bonus_token_id))


def generation(seed: int, new_tokens: int = NEW_TOKENS, greedy: bool = False) -> Generation:
    params = sampling.SamplingParams(temperature=0.0 if greedy else 1.0)
    return Generation(prompt_token_ids=PROMPT, max_new_tokens=new_tokens, sampling=params, seed=seed,
                      num_speculative_tokens=K, policy="fixed", proposer="draft-model",
                      eos_token_ids=frozenset())


def run(gen: Generation, loop: Any = speculation.speculate, greedy: bool = False,
        draft_law: torch.Tensor = DRAFT) -> tuple[list[int], list[Step], TableDraft, TableTarget]:
    draft, target = TableDraft(draft_law), TableTarget(TARGET, greedy)
    proposer = DraftModelProposer(draft, max_support_size=VOCAB, overlap=False)

    async def steps() -> list[Step]:
        return [step async for step in loop(gen, proposer, target, CostModel())]

    done = asyncio.run(steps())
    assert not proposer.lost  # no draft fallback: every verifying step was speculation
    return [t for s in done for t in s.token_ids], done, draft, target


def target_greedy(n: int) -> list[int]:
    """The target's own greedy continuation of PROMPT, n tokens."""
    tokens, last = [], PROMPT[-1]
    for _ in range(n):
        last = int(TARGET[last].argmax())
        tokens.append(last)
    return tokens


def cell(tokens: list[int]) -> int:
    return (tokens[0] * VOCAB + tokens[1]) * VOCAB + tokens[2]


def exact_law() -> torch.Tensor:
    law = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for a, b, c in itertools.product(range(VOCAB), repeat=3):
        law[a, b, c] = TARGET[PROMPT[-1], a] * TARGET[a, b] * TARGET[b, c]
    return law.reshape(-1)


def counts(loop: Any, samples: int = 2000) -> torch.Tensor:
    cells = [cell(run(generation(seed), loop)[0]) for seed in range(samples)]
    return torch.bincount(torch.tensor(cells), minlength=VOCAB**3)


def test_the_loop_samples_the_targets_law() -> None:
    assert p_value(counts(speculation.speculate), exact_law()) > ALPHA


def test_the_law_test_catches_one_uniform_reused_across_a_block() -> None:
    reused = mutant(speculation.speculate,
                    "torch.rand(len(block.token_ids), generator=rng, dtype=torch.float64).tolist()",
                    "[float(torch.rand(1, generator=rng, dtype=torch.float64))] * len(block.token_ids)")
    assert p_value(counts(reused), exact_law()) < ALPHA


def test_after_keeping_m_of_k_the_caches_roll_back_to_what_became_history() -> None:
    """The target's next step starts at n + m (the kept prefix), the draft's at
    min(n + k - 1, n + m) (it fed itself all but its last drafted token). Off by one, the loop
    would only re-send tokens, so no output test could see it."""
    for seed in range(40):
        _, steps, draft, target = run(generation(seed, new_tokens=12))
        n = len(PROMPT) + len(steps[0].token_ids)  # after the prefill step
        remaining = 12 - len(steps[0].token_ids)
        decode = [s for s in steps if not s.prefill]
        for i, step in enumerate(decode[:-1]):
            m, k = step.accepted, step.drafted
            assert k == min(K, remaining - 1)  # every verifying step drafted its k (no fallback)
            remaining -= len(step.token_ids)
            assert target.positions[i + 2] == n + m
            if decode[i + 1].drafted:  # the next step asked the draft (a k of 0 does not)
                assert draft.positions[i + 2] == min(n + k - 1, n + m)
            n += len(step.token_ids)


@pytest.mark.parametrize("draft_law", [DRAFT, TARGET], ids=["close-draft", "same-draft"])
def test_greedy_output_is_the_targets_own(draft_law: torch.Tensor) -> None:
    for seed in range(10):
        tokens, steps, _, _ = run(generation(seed, new_tokens=10, greedy=True), greedy=True,
                                  draft_law=draft_law)
        assert tokens == target_greedy(10)
        remaining = 10
        for step in steps:
            if not step.prefill:
                assert step.drafted == min(K, remaining - 1)  # every verifying step drafted its k
            remaining -= len(step.token_ids)


class RunningTarget(TableTarget):
    """A TableTarget that also answers decode runs (greedy), one response per token, and
    counts the requests it was sent."""

    def __init__(self, law: torch.Tensor) -> None:
        super().__init__(law, greedy=True)
        self.requests: list[str] = []

    async def _step(self, method: str, build: Any) -> Any:
        self.requests.append("step")
        return await super()._step(method, build)

    async def _stream(self, method: str, build: Any) -> Any:
        request: target_pb2.ScoreBlocksRequest = build(self.synced)
        self.requests.append("run")
        assert request.WhichOneof("proposal") == "decode_run"
        self.cache = self.cache[:request.cache_position] + list(request.new_token_ids)
        for _ in range(request.decode_run.max_tokens):
            token = int(row(self.law, self.cache).argmax())
            self.cache.append(token)
            yield target_pb2.ScoreBlocksResponse(cache_length=len(self.cache) - 1, compute_ms=1.0,
                                                 block_scores=target_pb2.BlockScores(bonus_token_id=token))


def test_a_request_the_policy_keeps_plain_decodes_in_runs_not_a_round_trip_per_token() -> None:
    """Adaptive, with the load rule at k = 0 (`--speculation-by-batch 1-:0`): after the prefill
    the target decodes alone, in runs as long as the policy goes before looking again."""
    from orchestrator.policy import BatchTable, Deployment

    gen = Generation(prompt_token_ids=PROMPT, max_new_tokens=40, sampling=sampling.SamplingParams(),
                     seed=0, num_speculative_tokens=K, policy="adaptive", proposer="draft-model",
                     eos_token_ids=frozenset())
    draft, target = TableDraft(DRAFT), RunningTarget(TARGET)
    proposer = DraftModelProposer(draft, max_support_size=VOCAB, overlap=False)
    costs = CostModel(deployment=Deployment(by_batch=BatchTable.parse("1-:0", K)))

    async def steps() -> list[Step]:
        return [step async for step in speculation.speculate(gen, proposer, target, costs)]

    done = asyncio.run(steps())
    assert [t for s in done for t in s.token_ids] == target_greedy(40)
    assert not any(s.drafted for s in done)
    # The prefill's step, then 39 tokens in runs of at most 16 (the policy's probe interval).
    assert target.requests == ["step", "run", "run", "run"], target.requests


class HeldDraft(TableDraft):
    """A draft whose prefill takes as long as the test says (a draft on slower hardware than
    the target's)."""

    def __init__(self, law: torch.Tensor) -> None:
        super().__init__(law)
        self.release = asyncio.Event()

    async def _step(self, method: str, build: Any) -> Any:
        if not self.cache:  # its prefill
            await self.release.wait()
        return await super()._step(method, build)


def test_the_first_token_does_not_wait_for_the_drafts_prefill() -> None:
    gen = generation(seed=3, new_tokens=8, greedy=True)

    async def scenario() -> list[Step]:
        draft, target = HeldDraft(DRAFT), TableTarget(TARGET, greedy=True)
        proposer = DraftModelProposer(draft, max_support_size=VOCAB, overlap=False)
        steps = speculation.speculate(gen, proposer, target, CostModel())
        first = await asyncio.wait_for(anext(steps), 10)  # the draft still takes in the prompt
        assert first.prefill and len(first.token_ids) == 1 and not draft.cache
        draft.release.set()  # the next step, the first that drafts, waits for it
        return [first, *[step async for step in steps]]

    done = asyncio.run(scenario())
    assert [t for s in done for t in s.token_ids] == target_greedy(8)
    # Every later step drafted (the last one, with one token left, cannot).
    assert all(s.drafted for s in done[1:-1]) and done[-1].drafted == 0, [s.drafted for s in done]
