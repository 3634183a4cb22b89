"""What the speculation loop does for a request's grammar and log-probabilities.

The orchestrator follows the grammar beside the history it owns (tandem.grammar): it commits
what the grammar forces without a model call, cuts proposals where the grammar forbids them,
and ends the reply where the grammar allows nothing. The replicas mask their own rows with
their own copies of the state (see docs/ARCHITECTURE.md, "Structured output").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrator.domain import DraftBlock, TargetResult, TargetScores, TokenLogprob
from orchestrator.suffix import Proposal
from tandem.grammar import GrammarState


@dataclass
class Constraint:
    """A request's grammar state after its history (None: no grammar)."""

    state: GrammarState | None = None

    def dead_end(self, history: list[int]) -> bool:
        """Whether the grammar allows no token after `history` (it failed: a parser limit)."""
        if self.state is None:
            return False
        self.state.follow(history)
        return not bool(self.state.allowed().any())

    def forced(self, history: list[int], most: int) -> list[int]:
        """The tokens the grammar forces after `history` (each the only one it allows)."""
        if self.state is None or most < 1:
            return []
        self.state.follow(history)
        return self.state.forced(most)

    def cut_block(self, history: list[int], block: DraftBlock) -> DraftBlock:
        """`block` up to and including its first token the grammar forbids: the target rejects
        that one (p = 0 there) and draws the recovered token from its masked residual, which
        needs that token's q; what follows it would only be thrown away."""
        if self.state is None or not block.token_ids:
            return block
        self.state.follow(history)
        keep = self.state.admits(block.token_ids) + 1
        if keep >= len(block.token_ids):
            return block
        return replace(block, token_ids=block.token_ids[:keep], distributions=block.distributions[:keep],
                       draft_probs=block.draft_probs[:keep])

    def cut_free(self, history: list[int], proposal: Proposal) -> Proposal:
        """A free (one-hot) proposal cut before its first forbidden token: with q one-hot there,
        the recovered token's residual is the masked p itself, what the row's bonus draw takes."""
        if self.state is None or not proposal.block.token_ids:
            return proposal
        self.state.follow(history)
        return proposal.cut(self.state.admits(proposal.block.token_ids))

    def allowed(self, history: list[int], new: list[int]) -> int:
        """How many of the committed `new` tokens the grammar allows in a row after `history`
        (fewer only where it failed on the way)."""
        if self.state is None:
            return len(new)
        return max(0, self.state.follow([*history, *new]) - (len(history) - self.state.start))


NO_CONSTRAINT = Constraint()


def step_logprobs(result: TargetResult, accepted: int, new: list[int]) -> tuple[TokenLogprob, ...]:
    """Each committed token's log-probability from the rows of the pass that verified it: a
    kept drafted token at its own row, the recovered or bonus token at the row after them."""
    if not isinstance(result, TargetScores) or not result.scored.logprobs:
        return ()
    rows = result.scored.logprobs
    out = []
    for i, token in enumerate(new):
        row = rows[i]
        out.append(TokenLogprob(token, row.drafted if i < accepted else row.drawn, row.top_token_ids,
                                row.top_logprobs))
    return tuple(out)
