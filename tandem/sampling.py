"""Sampling and exact speculative verification: the only copy of this maths in Tandem.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318). The draft proposes x_1..x_k, each x_i ~ q_i. The target gives
p_1..p_{k+1} in one forward pass. Then, in order:

    keep x_i with probability min(1, p_i(x_i) / q_i(x_i));
    at the first rejection, emit a *recovered* token ~ norm(max(0, p_i - q_i)) and stop;
    if all k are kept, emit a *bonus* token ~ p_{k+1}.

The emitted tokens are distributed exactly as the target alone would sample them.
p and q must be the distributions *after* the request's own temperature, top-k and
top-p (a draft that reports its raw distribution while sampling from a warped one
breaks the rule; vLLM #10198, transformers #47932), both in float32.

The work is split across processes without changing the maths: the target service
draws the recovered token for every position and the bonus token up front
(`score_block`), and the orchestrator decides how many drafted tokens to keep with
its own uniforms (`num_accepted`). A recovered token drawn for a position that is
not the first rejection is simply unused, so the joint law is unchanged.

Greedy decoding (temperature 0) is the same rule with one-hot p and q: a drafted
token is kept iff it is the target's argmax, and the recovered token is the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tandem import host

# Probabilities and draws are float32 whatever the model's dtype. They are computed where the
# logits are (the model's device), each step with a generator of that device seeded by the
# step's seed: a seed means the same draws on replicas of the same device kind (a CPU's and
# a GPU's generators differ); only the values a step needs are read to the host
# (tandem.host).
_F32 = torch.float32


@dataclass(frozen=True)
class SamplingParams:
    """The request's sampling parameters. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SparseDistribution:
    """A distribution that is exactly zero outside `token_ids` (probs sum to 1)."""

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class RowLogprobs:
    """One scored row's log-probabilities under the model itself: its log-softmax, before
    temperature, top-k, top-p and any grammar (what vLLM returns by default)."""

    drafted: float  # the drafted token's at this row (0.0 at the bonus row, which has none)
    drawn: float  # the recovered (or, at the bonus row, the bonus) token's
    top_token_ids: tuple[int, ...]  # the row's most likely tokens, most likely first
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class ScoredBlock:
    """What the target contributes to one verification step."""

    target_probs: tuple[float, ...]  # p_i(x_i) for each drafted token
    recovered_token_ids: tuple[int, ...]  # one per drafted position
    bonus_token_id: int
    logprobs: tuple[RowLogprobs, ...] = ()  # one per row (k + 1), where the step asked for them


def validate(params: SamplingParams) -> None:
    """Raise ValueError naming the field and its allowed range."""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"sampling.temperature must be finite and >= 0, got {params.temperature}")
    if params.top_k < 0:
        raise ValueError(f"sampling.top_k must be >= 0 (0 disables it), got {params.top_k}")
    if not (0.0 < params.top_p <= 1.0) or math.isnan(params.top_p):
        raise ValueError(f"sampling.top_p must be in (0, 1], got {params.top_p}")


# argmax over a vocabulary-wide row in blocks of this many: the blocks' maxima first (a
# vectorised reduction), then an index search inside the first block holding the maximum.
_ARGMAX_BLOCK = 128


def _blocked(logits: torch.Tensor) -> int:
    """How many leading ids of each row the block searches cover (whole blocks), or 0 where
    they do not pay: off a CPU, a vocabulary under 8 blocks, or rows not laid out contiguously."""
    full = logits.shape[-1] // _ARGMAX_BLOCK * _ARGMAX_BLOCK
    return full if logits.device.type == "cpu" and full >= 8 * _ARGMAX_BLOCK and logits.is_contiguous() else 0


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for logits [n, vocab], the lowest id among ties as there (and in HF's
    greedy search); on a CPU about ten times faster for a 152k vocabulary, whose index-tracking
    argmax is not vectorised. A row holding NaN goes to the plain argmax."""
    n, vocab = logits.shape
    full = _blocked(logits)
    if not full:
        return logits.argmax(-1)
    blocks = logits.as_strided((n, full // _ARGMAX_BLOCK, _ARGMAX_BLOCK), (vocab, _ARGMAX_BLOCK, 1))
    maxima = blocks.amax(-1)  # [n, blocks]
    best_block = maxima.argmax(-1)  # the first block holding each row's maximum
    rows = torch.arange(n)
    inside = blocks[rows, best_block].argmax(-1)
    best = best_block * _ARGMAX_BLOCK + inside
    if full < vocab:  # the tail past the last whole block: only a strictly larger value wins
        tail = logits[:, full:]
        tail_max, tail_at = tail.max(-1)
        best = torch.where(tail_max > maxima[rows, best_block], full + tail_at, best)
    if bool(maxima.isnan().any()) or (full < vocab and bool(logits[:, full:].isnan().any())):
        return logits.argmax(-1)  # amax carries a NaN into its block's maximum
    return best


def top_tokens(logits: torch.Tensor, n: int) -> list[int]:
    """The `n` most likely ids of one row of logits [vocab], most likely first (ties in any
    order): on a CPU, the top n within the n blocks of the largest maxima, which hold them."""
    vocab = logits.shape[-1]
    n = min(n, vocab)
    if _blocked(logits) != vocab:  # no tail past the last whole block here
        return host.values(torch.topk(logits, n).indices)
    blocks = logits.view(-1, _ARGMAX_BLOCK)  # [blocks, block]
    chosen = torch.topk(blocks.amax(-1), n).indices  # the blocks holding the n largest values
    candidates = (chosen[:, None] * _ARGMAX_BLOCK + torch.arange(_ARGMAX_BLOCK)).flatten()
    return host.values(candidates[torch.topk(logits[candidates], n).indices])


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: logits [n, vocab] -> probs [n, vocab], float32."""
    logits = logits.to(_F32)
    if params.greedy:
        # NOTE: ties go to the lowest id, as torch.argmax and HF greedy search do.
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).to(_F32)
    # Shifted by the row maximum before dividing: the same softmax, but a tiny temperature
    # (down to float32 subnormals) cannot overflow the logits to inf and the probs to NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # NOTE: tokens tied with the k-th are kept too (as in HF's and vLLM's top-k), so more
        # than k may remain. Draft and target use this same function, so it is exact either way.
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return probs


# Top-p looks at this many of the most likely tokens first, then at _TOP_P_SECOND, until they
# hold top_p of the mass; a flatter distribution than that has its whole row sorted.
_TOP_P_FIRST, _TOP_P_SECOND = 64, 1024


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop each token whose more likely tokens already hold `top_p` of the mass (the first
    always stays), and renormalise. Every token past the first k most likely is dropped once
    those k hold top_p, so only they need sorting: a few dozen, not the whole vocabulary."""
    vocab = probs.shape[-1]
    for k in (_TOP_P_FIRST, _TOP_P_SECOND, vocab):
        k = min(k, vocab)
        kept, order = torch.topk(probs, k, dim=-1)  # sorted, most likely first
        if k == vocab or bool((kept.sum(-1) >= top_p).all()):
            break
    mass_before = torch.cumsum(kept, dim=-1) - kept
    kept = kept.masked_fill(mass_before >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(-1, keepdim=True)


def truncate(probs: torch.Tensor, max_support_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the `max_support_size` most likely tokens of probs [vocab] and renormalise.

    Returns (token_ids [K], probs [K]). Sampling from this is what makes a sparse q exact.
    """
    k = min(max_support_size, int(host.to_host((probs > 0).sum())))
    top = torch.topk(probs, k)
    return top.indices, top.values / top.values.sum()


def draft_distribution(logits: torch.Tensor, params: SamplingParams, max_support_size: int
                       ) -> SparseDistribution:
    """A draft's q at one position from its logits [vocab], on the host: the `max_support_size`
    most likely tokens of `probabilities`, renormalised (`truncate`). Greedy: the argmax alone,
    what truncating the one-hot distribution gives, without building it."""
    if params.greedy:
        return SparseDistribution((int(host.to_host(argmax(logits[None])[0])),), (1.0,))
    support, probs = truncate(probabilities(logits[None], params)[0], max_support_size)
    return SparseDistribution(tuple(host.values(support)), tuple(host.values(probs)))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [n, vocab] -> [n] (rows need not sum to 1): where each row's
    cumulative distribution, in float64, passes a uniform draw scaled to the row's mass.

    The inverse of the distribution function: exact, one uniform per row, and on a CPU some
    twenty times cheaper than torch.multinomial over a 152k vocabulary. A token without mass
    is never drawn (its cumulative value equals the one before it)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=probs.device) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True)
    # u times the mass may round up to the mass itself: then the first index reaching it, the
    # last token with mass, not one past the end.
    drawn = torch.where(drawn >= probs.shape[-1], torch.searchsorted(cdf, u, right=False), drawn)
    return drawn.squeeze(-1)


def dense(dist: SparseDistribution, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sparse q as a dense row [vocab]."""
    row = torch.zeros(vocab_size, dtype=_F32, device=device)
    row[torch.tensor(dist.token_ids, device=device)] = torch.tensor(dist.probs, dtype=_F32, device=device)
    return row


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request seeded `seed` that asks for several: choice 0
    keeps the request's own (what the request with one choice draws), the others their own."""
    return seed if choice == 0 else position_seed(seed, -1 - choice) >> 2


def position_seed(seed: int, position: int) -> int:
    """A seed for the draw at absolute `position` of a request seeded `seed` (splitmix64 of
    both): what keys a draw to the history, not to a step, so that it is the same whenever
    and wherever it is made (a draft's block drafted ahead, a target's run resent)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A step's source of draws, on the device its probabilities are on."""
    return torch.Generator(device=device).manual_seed(seed)


def score_block(
    target_probs: torch.Tensor,  # [k+1, vocab], from probabilities()
    draft_token_ids: list[int],  # [k]
    draft_distributions: list[SparseDistribution],  # [k]
    generator: torch.Generator,
) -> ScoredBlock:
    """The target's half of verification: p_i(x_i), the recovered tokens and the bonus token."""
    k = len(draft_token_ids)
    vocab, device = target_probs.shape[-1], target_probs.device
    draft = torch.stack([dense(d, vocab, device) for d in draft_distributions]) if k else target_probs[:0]
    # Recovered distribution norm(max(0, p - q)). Where it is all zero (p == q), a rejection
    # has probability 0, so any token will do; p keeps the draw well defined.
    residual = (target_probs[:k] - draft).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[:k])
    draws = host.values(sample(torch.cat([residual, target_probs[k:]]), generator))
    ids = torch.tensor(draft_token_ids, dtype=torch.long, device=device)
    return ScoredBlock(
        target_probs=tuple(host.values(target_probs[torch.arange(k, device=device), ids])),
        recovered_token_ids=tuple(draws[:k]),
        bonus_token_id=int(draws[k]),
    )


def score_logits(
    logits: torch.Tensor,  # [k+1, vocab]: the target's rows after the history and each drafted token
    params: SamplingParams,
    draft_token_ids: list[int],  # [k]
    draft_distributions: list[SparseDistribution],  # [k]
    seed: int,
    masks: torch.Tensor | None = None,  # [k+1, vocab] bool: the tokens a grammar allows at each row
    top_logprobs: int | None = None,  # the rows' log-probabilities, with their top N (None: none)
) -> ScoredBlock:
    """`score_block` of the request's `probabilities`, where the logits are. Greedy needs only
    each row's argmax: p is one-hot there, so p(x_i) is 1 or 0 and every recovered and bonus
    draw is the argmax, which is what the one-hot rows give, without building them.

    Under a grammar p is the target's law masked to what the grammar allows and renormalised:
    the forbidden logits are -inf before temperature, top-k and top-p, as a logits processor
    sets them (a row must allow at least one token)."""
    raw = logits
    if masks is not None:
        logits = logits.to(_F32).masked_fill(~masks.to(logits.device), -math.inf)
    if params.greedy:
        scored = score_greedy(argmax(logits), draft_token_ids)
    else:
        scored = score_block(probabilities(logits, params), draft_token_ids, draft_distributions,
                             generator(seed, logits.device))
    if top_logprobs is None:
        return scored
    drawn = [*scored.recovered_token_ids, scored.bonus_token_id]
    return replace(scored, logprobs=row_logprobs(raw, draft_token_ids, drawn, top_logprobs))


def row_logprobs(logits: torch.Tensor, draft_token_ids: list[int], drawn_token_ids: list[int],
                 top: int) -> tuple[RowLogprobs, ...]:
    """Each row's log-softmax at its drafted token, at its drawn token and at its `top` most
    likely tokens, from logits [k+1, vocab]."""
    logprobs = torch.log_softmax(logits.to(_F32), dim=-1)
    rows = torch.arange(logprobs.shape[0], device=logprobs.device)
    drafted = host.values(logprobs[rows[:-1], torch.tensor(draft_token_ids, dtype=torch.long, device=logprobs.device)]
                          ) if draft_token_ids else []
    drawn = host.values(logprobs[rows, torch.tensor(drawn_token_ids, dtype=torch.long, device=logprobs.device)])
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)  # top 0: empty rows
    top_ids, top_values = host.values(best.indices), host.values(best.values)
    return tuple(RowLogprobs(drafted=float(drafted[i]) if i < len(drafted) else 0.0, drawn=float(drawn[i]),
                             top_token_ids=tuple(top_ids[i]), top_logprobs=tuple(float(v) for v in top_values[i]))
                 for i in range(logprobs.shape[0]))


def score_greedy(best: torch.Tensor, draft_token_ids: list[int]) -> ScoredBlock:
    """`score_logits` under greedy decoding, from each row's argmax [k+1] alone."""
    ids = host.values(best)
    return ScoredBlock(target_probs=tuple(1.0 if ids[i] == x else 0.0 for i, x in enumerate(draft_token_ids)),
                       recovered_token_ids=tuple(ids[:-1]), bonus_token_id=ids[-1])


def num_accepted(
    target_probs: list[float] | tuple[float, ...],  # p_i(x_i), [k]
    draft_probs: list[float] | tuple[float, ...],  # q_i(x_i), [k]
    uniforms: list[float],  # u_i ~ U[0, 1), [k]
) -> int:
    """The orchestrator's half: how many drafted tokens to keep.

    x_i is kept iff u_i < p_i(x_i) / q_i(x_i), written u_i * q_i < p_i to avoid the division.
    """
    for i, (p, q, u) in enumerate(zip(target_probs, draft_probs, uniforms, strict=True)):
        if not u * q < p:
            return i
    return len(target_probs)


def commit(
    draft_token_ids: list[int] | tuple[int, ...], scored: ScoredBlock, accepted: int
) -> list[int]:
    """The tokens one step commits: the accepted prefix, then a recovered or bonus token."""
    if accepted < len(draft_token_ids):
        return [*draft_token_ids[:accepted], scored.recovered_token_ids[accepted]]
    return [*draft_token_ids, scored.bonus_token_id]


@dataclass(frozen=True)
class TreeVerdict:
    """The outcome of verifying a token tree."""

    accepted_nodes: tuple[int, ...]  # node indices along the kept path, root side first
    next_token_id: int  # the recovered or bonus token after the path


def verify_tree(
    target_probs: torch.Tensor,  # [1 + t, vocab]: row 0 after the root, row 1 + j after node j
    token_ids: list[int] | tuple[int, ...],  # [t] node tokens
    parents: list[int] | tuple[int, ...],  # [t] parent node of each node, -1 for the root's children
    generator: torch.Generator,
) -> TreeVerdict:
    """Walk a tree of deterministic candidates from the root, keeping the target's exact law.

    The candidates are a function of the history alone (Medusa heads, Lookahead's n-gram
    pool), so each is a one-hot draft (q = 1 at the candidate). At a node whose children carry
    tokens c_1..c_m in tree order, starting from r = p:

        keep c_j with probability r(c_j) / sum(r), and descend into it;
        otherwise set r(c_j) = 0 and try c_{j+1};
        when no child is kept, emit a token ~ norm(r) and stop (recovered, or bonus at a leaf).

    This draws from p without replacement, one candidate at a time, so every emitted token
    is distributed exactly as p (SpecInfer, Miao et al. 2024, arXiv 2305.09781, with
    one-hot drafts). Under greedy decoding p is one-hot: a child is kept iff it is the
    target's argmax, and the emitted token is the argmax.
    """
    children: list[list[int]] = [[] for _ in range(len(token_ids) + 1)]
    for node, parent in enumerate(parents):
        assert parent < node, "parents must precede their children"
        children[parent + 1].append(node)
    path: list[int] = []
    row = 0  # target_probs row of the current node (0: the root)
    while True:
        residual = target_probs[row].to(_F32).clone()
        for child in children[row]:
            token = token_ids[child]
            mass, chosen = host.values(torch.stack([residual.double().sum(), residual[token].double()]))
            u = float(host.to_host(torch.rand(1, generator=generator, dtype=torch.float64,
                                              device=generator.device)))
            if u * mass < chosen:
                path.append(child)
                row = child + 1
                break
            residual[token] = 0.0
        else:
            if float(host.to_host(residual.sum())) <= 0.0:
                # Every token with mass was a rejected candidate: impossible in exact arithmetic
                # (the last one is kept with probability 1); guards float rounding.
                residual = target_probs[row].to(_F32)
            return TreeVerdict(tuple(path), int(host.to_host(sample(residual[None], generator)[0])))
