from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllocateKVRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "num_reserved_output_tokens", "prefill_layout", "ttl_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    num_reserved_output_tokens: int
    prefill_layout: _common_pb2.KVLayout
    ttl_s: float
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_reserved_output_tokens: _Optional[int] = ..., prefill_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class AllocateKVResponse(_message.Message):
    __slots__ = ("layout", "block_tables", "transfer_modes", "expires_at_unix_ms")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.KVLayout
    block_tables: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockTable]
    transfer_modes: _containers.RepeatedScalarFieldContainer[_common_pb2.TransferMode]
    expires_at_unix_ms: int
    def __init__(self, layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., block_tables: _Optional[_Iterable[_Union[_common_pb2.BlockTable, _Mapping]]] = ..., transfer_modes: _Optional[_Iterable[_Union[_common_pb2.TransferMode, str]]] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "first_token_logprob", "sampling_params", "kv_handle", "num_cached_tokens", "first_token_ids", "first_token_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    first_token_logprob: float
    sampling_params: _common_pb2.SamplingParams
    kv_handle: _common_pb2.KVHandle
    num_cached_tokens: int
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., first_token_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs", "finish_reason", "num_output_tokens", "kv_transfer_s", "decode_s", "error_message", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    num_output_tokens: int
    kv_transfer_s: float
    decode_s: float
    error_message: str
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_output_tokens: _Optional[int] = ..., kv_transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., error_message: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class CancelDecodeRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelDecodeResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
