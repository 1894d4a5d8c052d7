from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeTarget(_message.Message):
    __slots__ = ("decode_pod_id", "layout", "transfer_modes")
    DECODE_POD_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODES_FIELD_NUMBER: _ClassVar[int]
    decode_pod_id: str
    layout: _common_pb2.KVLayout
    transfer_modes: _containers.RepeatedScalarFieldContainer[_common_pb2.TransferMode]
    def __init__(self, decode_pod_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., transfer_modes: _Optional[_Iterable[_Union[_common_pb2.TransferMode, str]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "decode_target", "transfer_mode", "lease_id", "lease_ttl_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TARGET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    decode_target: DecodeTarget
    transfer_mode: _common_pb2.TransferMode
    lease_id: str
    lease_ttl_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_target: _Optional[_Union[DecodeTarget, _Mapping]] = ..., transfer_mode: _Optional[_Union[_common_pb2.TransferMode, str]] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "first_token_top_logprobs", "num_prompt_tokens", "num_cached_tokens", "kv_handle", "finished", "finish_reason", "queue_s", "compute_s", "first_tokens", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    first_token_top_logprobs: _common_pb2.TopLogprobs
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_handle: _common_pb2.KVHandle
    finished: bool
    finish_reason: _common_pb2.FinishReason
    queue_s: float
    compute_s: float
    first_tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampledToken]
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., first_token_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., queue_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., first_tokens: _Optional[_Iterable[_Union[_common_pb2.SampledToken, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class CancelPrefillRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelPrefillResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
