from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_NONE: _ClassVar[Proposer]
    PROPOSER_DRAFT_MODEL: _ClassVar[Proposer]
    PROPOSER_PROMPT_LOOKUP: _ClassVar[Proposer]
    PROPOSER_LOOKAHEAD: _ClassVar[Proposer]
    PROPOSER_MEDUSA: _ClassVar[Proposer]
    PROPOSER_SUFFIX: _ClassVar[Proposer]
    PROPOSER_AUTO: _ClassVar[Proposer]
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_NONE: Proposer
PROPOSER_DRAFT_MODEL: Proposer
PROPOSER_PROMPT_LOOKUP: Proposer
PROPOSER_LOOKAHEAD: Proposer
PROPOSER_MEDUSA: Proposer
PROPOSER_SUFFIX: Proposer
PROPOSER_AUTO: Proposer

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "tokenizer_fingerprint", "max_context_tokens", "eos_token_ids", "dtype", "device", "proposers", "boot_id", "cpu_ids", "accelerator_ids", "matmul_path", "pass_times", "backend", "backend_timings")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    CPU_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_IDS_FIELD_NUMBER: _ClassVar[int]
    MATMUL_PATH_FIELD_NUMBER: _ClassVar[int]
    PASS_TIMES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_context_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    proposers: _containers.RepeatedScalarFieldContainer[Proposer]
    boot_id: str
    cpu_ids: _containers.RepeatedScalarFieldContainer[int]
    accelerator_ids: _containers.RepeatedScalarFieldContainer[str]
    matmul_path: str
    pass_times: _containers.RepeatedCompositeFieldContainer[PassTime]
    backend: str
    backend_timings: _containers.RepeatedCompositeFieldContainer[BackendTiming]
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., proposers: _Optional[_Iterable[_Union[Proposer, str]]] = ..., boot_id: _Optional[str] = ..., cpu_ids: _Optional[_Iterable[int]] = ..., accelerator_ids: _Optional[_Iterable[str]] = ..., matmul_path: _Optional[str] = ..., pass_times: _Optional[_Iterable[_Union[PassTime, _Mapping]]] = ..., backend: _Optional[str] = ..., backend_timings: _Optional[_Iterable[_Union[BackendTiming, _Mapping]]] = ...) -> None: ...

class BackendTiming(_message.Message):
    __slots__ = ("backend", "pass_times", "expected_tokens_per_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PASS_TIMES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    backend: str
    pass_times: _containers.RepeatedCompositeFieldContainer[PassTime]
    expected_tokens_per_s: float
    def __init__(self, backend: _Optional[str] = ..., pass_times: _Optional[_Iterable[_Union[PassTime, _Mapping]]] = ..., expected_tokens_per_s: _Optional[float] = ...) -> None: ...

class PassTime(_message.Message):
    __slots__ = ("token_count", "pass_ms")
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PASS_MS_FIELD_NUMBER: _ClassVar[int]
    token_count: int
    pass_ms: float
    def __init__(self, token_count: _Optional[int] = ..., pass_ms: _Optional[float] = ...) -> None: ...

class PassSplit(_message.Message):
    __slots__ = ("host_before_ms", "forward_ms", "host_after_ms", "host_bytes", "pass_count", "captured_count")
    HOST_BEFORE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PASS_COUNT_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_COUNT_FIELD_NUMBER: _ClassVar[int]
    host_before_ms: float
    forward_ms: float
    host_after_ms: float
    host_bytes: int
    pass_count: int
    captured_count: int
    def __init__(self, host_before_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., host_after_ms: _Optional[float] = ..., host_bytes: _Optional[int] = ..., pass_count: _Optional[int] = ..., captured_count: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...
