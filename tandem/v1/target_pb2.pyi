from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreBlocksRequest(_message.Message):
    __slots__ = ("session_id", "cache_position", "new_token_ids", "sampling", "seed", "draft_proposal", "target_proposal", "decode_run", "grammar", "grammar_start_position", "top_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_RUN_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_position: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    draft_proposal: DraftProposal
    target_proposal: TargetProposal
    decode_run: DecodeRun
    grammar: _common_pb2.Grammar
    grammar_start_position: int
    top_logprobs: int
    def __init__(self, session_id: _Optional[str] = ..., cache_position: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., draft_proposal: _Optional[_Union[DraftProposal, _Mapping]] = ..., target_proposal: _Optional[_Union[TargetProposal, _Mapping]] = ..., decode_run: _Optional[_Union[DecodeRun, _Mapping]] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., grammar_start_position: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class DecodeRun(_message.Message):
    __slots__ = ("max_tokens", "stop_token_ids")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("token_ids", "distributions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class TargetProposal(_message.Message):
    __slots__ = ("proposer",)
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    proposer: _common_pb2.Proposer
    def __init__(self, proposer: _Optional[_Union[_common_pb2.Proposer, str]] = ...) -> None: ...

class ScoreBlocksResponse(_message.Message):
    __slots__ = ("cache_length", "compute_ms", "batch_session_count", "batch_token_count", "pass_ms", "queue_depth_count", "kv_cache_usage", "pass_split", "cached_token_count", "block_scores", "verified_tree")
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSION_COUNT_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PASS_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_COUNT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PASS_SPLIT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SCORES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_TREE_FIELD_NUMBER: _ClassVar[int]
    cache_length: int
    compute_ms: float
    batch_session_count: int
    batch_token_count: int
    pass_ms: float
    queue_depth_count: int
    kv_cache_usage: float
    pass_split: _common_pb2.PassSplit
    cached_token_count: int
    block_scores: BlockScores
    verified_tree: VerifiedTree
    def __init__(self, cache_length: _Optional[int] = ..., compute_ms: _Optional[float] = ..., batch_session_count: _Optional[int] = ..., batch_token_count: _Optional[int] = ..., pass_ms: _Optional[float] = ..., queue_depth_count: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., pass_split: _Optional[_Union[_common_pb2.PassSplit, _Mapping]] = ..., cached_token_count: _Optional[int] = ..., block_scores: _Optional[_Union[BlockScores, _Mapping]] = ..., verified_tree: _Optional[_Union[VerifiedTree, _Mapping]] = ...) -> None: ...

class BlockScores(_message.Message):
    __slots__ = ("target_probs", "recovered_token_ids", "bonus_token_id", "logprobs", "grammar_forced")
    TARGET_PROBS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FORCED_FIELD_NUMBER: _ClassVar[int]
    target_probs: _containers.RepeatedScalarFieldContainer[float]
    recovered_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bonus_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    grammar_forced: bool
    def __init__(self, target_probs: _Optional[_Iterable[float]] = ..., recovered_token_ids: _Optional[_Iterable[int]] = ..., bonus_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ..., grammar_forced: _Optional[bool] = ...) -> None: ...

class RowLogprobs(_message.Message):
    __slots__ = ("drafted_logprob", "drawn_logprob", "top_token_ids", "top_logprobs")
    DRAFTED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    DRAWN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    drafted_logprob: float
    drawn_logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, drafted_logprob: _Optional[float] = ..., drawn_logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifiedTree(_message.Message):
    __slots__ = ("committed_token_ids", "proposed_token_count")
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposed_token_count: int
    def __init__(self, committed_token_ids: _Optional[_Iterable[int]] = ..., proposed_token_count: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    def __init__(self, files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ...) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...
