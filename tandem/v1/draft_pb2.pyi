from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeBlocksRequest(_message.Message):
    __slots__ = ("session_id", "cache_position", "new_token_ids", "num_speculative_tokens", "sampling", "max_support_size", "seed", "draft_ahead_tokens", "grammar", "grammar_start_position")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_POSITION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_position: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_speculative_tokens: int
    sampling: _common_pb2.SamplingParams
    max_support_size: int
    seed: int
    draft_ahead_tokens: int
    grammar: _common_pb2.Grammar
    grammar_start_position: int
    def __init__(self, session_id: _Optional[str] = ..., cache_position: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_support_size: _Optional[int] = ..., seed: _Optional[int] = ..., draft_ahead_tokens: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., grammar_start_position: _Optional[int] = ...) -> None: ...

class ProposeBlocksResponse(_message.Message):
    __slots__ = ("token_ids", "distributions", "cache_length", "compute_ms", "prebuilt_tokens", "ahead_hit", "pass_split", "cached_token_count")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PREBUILT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HIT_FIELD_NUMBER: _ClassVar[int]
    PASS_SPLIT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    cache_length: int
    compute_ms: float
    prebuilt_tokens: int
    ahead_hit: bool
    pass_split: _common_pb2.PassSplit
    cached_token_count: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., cache_length: _Optional[int] = ..., compute_ms: _Optional[float] = ..., prebuilt_tokens: _Optional[int] = ..., ahead_hit: _Optional[bool] = ..., pass_split: _Optional[_Union[_common_pb2.PassSplit, _Mapping]] = ..., cached_token_count: _Optional[int] = ...) -> None: ...
