"""The proposers that live in the target, by the proposer enum: they need its forward pass
(Lookahead) or its hidden states (Medusa), so each is offered where the backend's
capabilities (tandem.lm.Capabilities) say it can run. What a proposer is:
target_service/candidates.py."""

from __future__ import annotations

import logging

from tandem.errors import InvalidRequest
from tandem.lm import Capabilities, CausalLM
from tandem.model_service import ModelServiceConfig
from tandem.v1 import common_pb2
from target_service.candidates import TargetProposer
from target_service.lookahead import LookaheadConfig, LookaheadProposer
from target_service.medusa import build_medusa

log = logging.getLogger(__name__)


def build_proposers(config: ModelServiceConfig, model: CausalLM, capabilities: Capabilities
                    ) -> dict[int, TargetProposer]:
    """The target proposers this replica's configuration enables and its backend can run,
    keyed by common_pb2.Proposer. Lookahead (on by default) is left out, logged, where the
    backend cannot run it; Medusa heads asked for on such a backend are refused."""
    proposers: dict[int, TargetProposer] = {}
    lookahead = LookaheadConfig.parse(config.lookahead)
    if lookahead is not None:
        why = capabilities.refusal(needs_hidden=False)
        if why is None:
            proposers[common_pb2.PROPOSER_LOOKAHEAD] = LookaheadProposer(lookahead)
        else:
            log.info("Lookahead is not offered: %s", why)
    if config.medusa_heads:
        why = capabilities.refusal(needs_hidden=True)
        if why is not None:
            raise InvalidRequest(f"--medusa-heads: {why}; serve the target on transformers "
                                 "(--backend transformers) for Medusa")
        proposers[common_pb2.PROPOSER_MEDUSA] = build_medusa(config.medusa_heads,
                                                             config.medusa_choices, model)
    return proposers
