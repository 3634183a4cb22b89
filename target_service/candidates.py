"""What a target proposer is and what it proposes: the seam between the scorer and the
proposers (Lookahead, Medusa). A leaf of target_service: the proposers and the scorer import
it, and it imports neither.

A target proposer builds a `Segment` of tokens to score after the step's history tokens,
in the same forward pass, and names which of them form the token tree to verify. The
seam follows transformers' candidate generators: `get_candidates` proposes from the
session's soft state, `update_candidate_strategy` sees the pass and the verdict and
updates that state for the next step.

Losslessness needs only that the candidates are a function of the history (never of
this step's random draws): `sampling.verify_tree` then keeps the target's exact law.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem import sampling
from tandem.kv import KVSession, Segment


@dataclass(frozen=True)
class Candidates:
    segment: Segment  # everything scored after the history this step
    tree_nodes: tuple[int, ...]  # [m] segment indices that form the tree to verify, parents first
    tree_parents: tuple[int, ...]  # [m] parent of each tree node, as an index into tree_nodes; -1: root

    @property
    def tree_token_ids(self) -> tuple[int, ...]:
        return tuple(self.segment.token_ids[i] for i in self.tree_nodes)


NO_CANDIDATES = Candidates(Segment((), (), torch.zeros(0, 0, dtype=torch.bool)), (), ())


class TargetProposer(Protocol):
    """One kind of proposer run by the target service (one instance per replica)."""

    #: Whether update_candidate_strategy needs the last hidden states.
    with_hidden: bool
    #: The most tokens a segment holds: the KV room a step takes, beyond the history, during the pass.
    max_segment_tokens: int

    def get_candidates(self, session: KVSession, new_token_ids: list[int]) -> Candidates:
        """The segment to score after `new_token_ids`, from the session's soft state (`session.states`)."""

    def update_candidate_strategy(self, session: KVSession, candidates: Candidates,
                                  logits: torch.Tensor, hidden: torch.Tensor | None,
                                  verdict: sampling.TreeVerdict) -> None:
        """Learn from this step's pass: logits [1 + t, vocab] and hidden [1 + t, h] (row 0
        after the last history token, row 1 + i after segment token i)."""
