"""Every conversion between the orchestrator's protos and its domain types, in one place.

The engine (orchestrator/engine.py) and the speculation loop see only domain types: requests,
events, usage, model info, sparse distributions and proposer names. The public gRPC API
(orchestrator/service.py) and the replicas' streams (orchestrator/remote.py) convert here.
"""

from __future__ import annotations

from typing import cast

from orchestrator.domain import (
    REGISTRY,
    Delta,
    DraftBlock,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    PassLoad,
    Summary,
    TargetResult,
    TargetScores,
    TokenLogprob,
    TreeCommit,
    Usage,
)
from tandem import sampling
from tandem.errors import InvalidRequest
from tandem.grammar import spec_from
from tandem.models import TokenizerFile
from tandem.split import split_from_proto, split_to_proto
from tandem.v1 import common_pb2, orchestrator_pb2, target_pb2

_PROPOSER_PREFIX = "PROPOSER_"


def proposer_to_proto(name: str) -> common_pb2.Proposer:
    """"prompt-lookup" -> PROPOSER_PROMPT_LOOKUP ("" -> PROPOSER_UNSPECIFIED)."""
    label = _PROPOSER_PREFIX + (name.upper().replace("-", "_") if name else "UNSPECIFIED")
    return cast(common_pb2.Proposer, common_pb2.Proposer.Value(label))


def proposer_from_proto(value: int) -> str:
    """PROPOSER_PROMPT_LOOKUP -> "prompt-lookup"; PROPOSER_UNSPECIFIED -> "" (the default)."""
    if value == common_pb2.PROPOSER_UNSPECIFIED:
        return ""
    if value not in common_pb2.Proposer.values():
        raise InvalidRequest(f"proposer value {value} is not a Proposer; choose one of: "
                             f"{', '.join(proposer_label(n) for n in REGISTRY)}")
    label: str = common_pb2.Proposer.Name(value)
    name = label.removeprefix(_PROPOSER_PREFIX).lower().replace("_", "-")
    assert name in REGISTRY, f"{name} is on the wire but not in the registry"
    return name


def proposer_label(name: str) -> str:
    """The enum's name, as gRPC users write it: PROPOSER_PROMPT_LOOKUP."""
    label: str = common_pb2.Proposer.Name(proposer_to_proto(name))
    return label


def sampling_to_proto(params: sampling.SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                     top_p=params.top_p)


def distribution_to_proto(dist: sampling.SparseDistribution) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=dist.token_ids, probs=dist.probs)


def distribution_from_proto(proto: common_pb2.SparseDistribution) -> sampling.SparseDistribution:
    return sampling.SparseDistribution(tuple(proto.token_ids), tuple(proto.probs))


def model_info_from_proto(proto: common_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(model=proto.model, vocab_size=proto.vocab_size,
                     tokenizer_fingerprint=proto.tokenizer_fingerprint,
                     max_context_tokens=proto.max_context_tokens,
                     eos_token_ids=tuple(proto.eos_token_ids),
                     proposers=frozenset(proposer_from_proto(p) for p in proto.proposers),
                     device=proto.device, boot_id=proto.boot_id, cpu_ids=frozenset(proto.cpu_ids),
                     accelerator_ids=frozenset(proto.accelerator_ids),
                     matmul_path=proto.matmul_path,
                     pass_ms=tuple((p.token_count, p.pass_ms) for p in proto.pass_times))


def score_request_to_proto(session_id: str, cache_position: int, new_token_ids: list[int],
                           block: DraftBlock, target_proposer: str,
                           params: sampling.SamplingParams, seed: int
                           ) -> target_pb2.ScoreBlocksRequest:
    """One target step: with `target_proposer` ("lookahead", "medusa"), the target proposes and
    verifies a tree itself; else it scores `block` (EMPTY_BLOCK: a plain step, no draft)."""
    request = target_pb2.ScoreBlocksRequest(
        session_id=session_id, cache_position=cache_position, new_token_ids=new_token_ids,
        sampling=sampling_to_proto(params), seed=seed)
    if target_proposer:
        assert not block.token_ids, "a target proposer's step carries no draft"
        request.target_proposal.proposer = proposer_to_proto(target_proposer)
    else:  # set even when empty: the oneof says which protocol the step speaks
        request.draft_proposal.SetInParent()
        request.draft_proposal.token_ids.extend(block.token_ids)
        request.draft_proposal.distributions.extend(
            distribution_to_proto(d) for d in block.distributions)
    return request


def decode_request_to_proto(session_id: str, cache_position: int, new_token_ids: list[int],
                            params: sampling.SamplingParams, seed: int, max_tokens: int,
                            stop_token_ids: frozenset[int]) -> target_pb2.ScoreBlocksRequest:
    """A run of up to `max_tokens` tokens the target decodes alone, seeded by the request's
    `seed` (each token by its position), ending early after a stop token."""
    return target_pb2.ScoreBlocksRequest(
        session_id=session_id, cache_position=cache_position, new_token_ids=new_token_ids,
        sampling=sampling_to_proto(params), seed=seed,
        decode_run=target_pb2.DecodeRun(max_tokens=max_tokens, stop_token_ids=sorted(stop_token_ids)))


def target_result_from_proto(proto: target_pb2.ScoreBlocksResponse) -> TargetResult | None:
    """The step's answer as its own domain type; None when the response carries neither kind
    (a target that predates the `result` oneof)."""
    kind = proto.WhichOneof("result")
    if kind == "block_scores":
        scores = proto.block_scores
        load = PassLoad(proto.batch_session_count, proto.batch_token_count, proto.pass_ms,
                        proto.queue_depth_count) if proto.batch_session_count else None
        return TargetScores(sampling.ScoredBlock(tuple(scores.target_probs),
                                                 tuple(scores.recovered_token_ids),
                                                 scores.bonus_token_id,
                                                 tuple(sampling.RowLogprobs(r.drafted_logprob, r.drawn_logprob,
                                                                            tuple(r.top_token_ids),
                                                                            tuple(r.top_logprobs))
                                                       for r in scores.logprobs)),
                            proto.cache_length, proto.compute_ms, load, split_from_proto(proto.pass_split),
                            proto.cached_token_count, scores.grammar_forced)
    if kind == "verified_tree":
        tree = proto.verified_tree
        return TreeCommit(tuple(tree.committed_token_ids), tree.proposed_token_count,
                          proto.cache_length, proto.compute_ms, split_from_proto(proto.pass_split),
                          proto.cached_token_count)
    return None


def tokenizer_files_from_proto(proto: target_pb2.GetTokenizerResponse
                               ) -> tuple[TokenizerFile, ...]:
    return tuple(TokenizerFile(f.name, f.content) for f in proto.files)


def request_from_proto(request: orchestrator_pb2.GenerateRequest
                       | orchestrator_pb2.GenerateUnaryRequest) -> GenerationRequest:
    """The public API's request (streaming or unary: the same fields) as the engine's."""
    params = request.sampling
    return GenerationRequest(
        prompt=request.prompt, prompt_token_ids=tuple(request.prompt_token_ids),
        max_new_tokens=request.max_new_tokens,
        temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p if params.top_p != 0 else 1.0,  # proto3: 0 is unset
        seed=request.seed if request.HasField("seed") else None,
        num_speculative_tokens=(request.num_speculative_tokens
                                if request.HasField("num_speculative_tokens") else None),
        stop_strings=tuple(request.stop_strings), ignore_eos=request.ignore_eos,
        proposer=proposer_from_proto(request.proposer), n=request.n or 1,
        grammar=spec_from(request.grammar),
        logprobs=request.logprobs if request.HasField("logprobs") else None)


_FINISH_REASONS = {FinishReason.LENGTH: orchestrator_pb2.FINISH_REASON_LENGTH,
                   FinishReason.EOS: orchestrator_pb2.FINISH_REASON_EOS,
                   FinishReason.STOP_STRING: orchestrator_pb2.FINISH_REASON_STOP_STRING,
                   FinishReason.GRAMMAR_DEAD_END: orchestrator_pb2.FINISH_REASON_GRAMMAR_DEAD_END}


def finish_reason_to_proto(reason: FinishReason) -> orchestrator_pb2.FinishReason:
    return _FINISH_REASONS[reason]


def usage_to_proto(usage: Usage, wire_bytes: int, total_ms: float) -> orchestrator_pb2.Usage:
    return orchestrator_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        drafted_tokens=usage.drafted_tokens, accepted_tokens=usage.accepted_tokens,
        rejected_tokens=usage.rejected_tokens, target_forward_passes=usage.target_forward_passes,
        wire_bytes=wire_bytes, draft_ms=usage.draft_ms, target_ms=usage.target_ms,
        prefill_ms=usage.prefill_ms, proposer=proposer_to_proto(usage.proposer),
        total_ms=total_ms, draft_wait_ms=usage.draft_wait_ms,
        draft_cache_hits=usage.draft_cache_hits, draft_cache_misses=usage.draft_cache_misses,
        draft_passes=split_to_proto(usage.draft_passes), target_passes=split_to_proto(usage.target_passes),
        orchestrator_ms=usage.orchestrator_ms, replica_wire_ms=usage.replica_wire_ms,
        target_cached_tokens=usage.target_cached_tokens, draft_cached_tokens=usage.draft_cached_tokens,
        suffix_drafted_tokens=usage.suffix_drafted_tokens, suffix_accepted_tokens=usage.suffix_accepted_tokens,
        grammar_forced_tokens=usage.grammar_forced_tokens)


def logprobs_to_proto(logprobs: tuple[TokenLogprob, ...]) -> list[orchestrator_pb2.TokenLogprob]:
    return [orchestrator_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, top_token_ids=t.top_token_ids,
                                          top_logprobs=t.top_logprobs) for t in logprobs]


def delta_to_proto(delta: Delta) -> orchestrator_pb2.GenerateResponse:
    return orchestrator_pb2.GenerateResponse(
        delta=orchestrator_pb2.TokenDelta(token_ids=delta.token_ids, text=delta.text,
                                          choice_index=delta.choice, logprobs=logprobs_to_proto(delta.logprobs)))


def summary_to_proto(summary: Summary) -> orchestrator_pb2.GenerationSummary:
    return orchestrator_pb2.GenerationSummary(
        finish_reason=finish_reason_to_proto(summary.finish_reason),
        usage=usage_to_proto(summary.usage, summary.wire_bytes, summary.total_ms),
        choice_index=summary.choice)

