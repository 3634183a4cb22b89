from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_GRAMMAR_DEAD_END: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_GRAMMAR_DEAD_END: FinishReason

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "drafted_tokens", "accepted_tokens", "target_forward_passes", "wire_bytes", "draft_ms", "target_ms", "total_ms", "prefill_ms", "proposer", "rejected_tokens", "draft_wait_ms", "draft_cache_hits", "draft_cache_misses", "draft_passes", "target_passes", "orchestrator_ms", "replica_wire_ms", "target_cached_tokens", "draft_cached_tokens", "suffix_drafted_tokens", "suffix_accepted_tokens", "grammar_forced_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PASSES_FIELD_NUMBER: _ClassVar[int]
    TARGET_PASSES_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    target_forward_passes: int
    wire_bytes: int
    draft_ms: float
    target_ms: float
    total_ms: float
    prefill_ms: float
    proposer: _common_pb2.Proposer
    rejected_tokens: int
    draft_wait_ms: float
    draft_cache_hits: int
    draft_cache_misses: int
    draft_passes: _common_pb2.PassSplit
    target_passes: _common_pb2.PassSplit
    orchestrator_ms: float
    replica_wire_ms: float
    target_cached_tokens: int
    draft_cached_tokens: int
    suffix_drafted_tokens: int
    suffix_accepted_tokens: int
    grammar_forced_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., target_forward_passes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., draft_ms: _Optional[float] = ..., target_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., proposer: _Optional[_Union[_common_pb2.Proposer, str]] = ..., rejected_tokens: _Optional[int] = ..., draft_wait_ms: _Optional[float] = ..., draft_cache_hits: _Optional[int] = ..., draft_cache_misses: _Optional[int] = ..., draft_passes: _Optional[_Union[_common_pb2.PassSplit, _Mapping]] = ..., target_passes: _Optional[_Union[_common_pb2.PassSplit, _Mapping]] = ..., orchestrator_ms: _Optional[float] = ..., replica_wire_ms: _Optional[float] = ..., target_cached_tokens: _Optional[int] = ..., draft_cached_tokens: _Optional[int] = ..., suffix_drafted_tokens: _Optional[int] = ..., suffix_accepted_tokens: _Optional[int] = ..., grammar_forced_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "seed", "num_speculative_tokens", "stop_strings", "ignore_eos", "proposer", "n", "grammar", "logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    num_speculative_tokens: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    proposer: _common_pb2.Proposer
    n: int
    grammar: _common_pb2.Grammar
    logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., proposer: _Optional[_Union[_common_pb2.Proposer, str]] = ..., n: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "summary")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    summary: GenerationSummary
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., summary: _Optional[_Union[GenerationSummary, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "choice_index", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    choice_index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., choice_index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerationSummary(_message.Message):
    __slots__ = ("finish_reason", "usage", "choice_index")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    choice_index: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., choice_index: _Optional[int] = ...) -> None: ...

class GenerateUnaryRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "sampling", "seed", "num_speculative_tokens", "stop_strings", "ignore_eos", "proposer", "n", "grammar", "logprobs")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    seed: int
    num_speculative_tokens: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    proposer: _common_pb2.Proposer
    n: int
    grammar: _common_pb2.Grammar
    logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., proposer: _Optional[_Union[_common_pb2.Proposer, str]] = ..., n: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateUnaryResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "choices", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
