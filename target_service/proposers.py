"""The proposers that live in the target, by the proposer enum: they need its forward pass
(Lookahead) or its hidden states (Medusa). What a proposer is: target_service/candidates.py."""

from __future__ import annotations

from tandem.lm import CausalLM
from tandem.model_service import ModelServiceConfig
from tandem.v1 import common_pb2
from target_service.candidates import TargetProposer
from target_service.lookahead import LookaheadConfig, LookaheadProposer
from target_service.medusa import build_medusa


def build_proposers(config: ModelServiceConfig, model: CausalLM) -> dict[int, TargetProposer]:
    """The target proposers this replica's configuration enables, keyed by common_pb2.Proposer."""
    proposers: dict[int, TargetProposer] = {}
    lookahead = LookaheadConfig.parse(config.lookahead)
    if lookahead is not None:
        proposers[common_pb2.PROPOSER_LOOKAHEAD] = LookaheadProposer(lookahead)
    if config.medusa_heads:
        proposers[common_pb2.PROPOSER_MEDUSA] = build_medusa(config.medusa_heads,
                                                             config.medusa_choices, model)
    return proposers
