from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling_params", "model", "return_prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    chat: ChatPrompt
    sampling_params: _common_pb2.SamplingParams
    model: str
    return_prompt_token_ids: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class RoutingInfo(_message.Message):
    __slots__ = ("prefill_pod_id", "decode_pod_id", "transfer_mode")
    PREFILL_POD_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_POD_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    prefill_pod_id: str
    decode_pod_id: str
    transfer_mode: _common_pb2.TransferMode
    def __init__(self, prefill_pod_id: _Optional[str] = ..., decode_pod_id: _Optional[str] = ..., transfer_mode: _Optional[_Union[_common_pb2.TransferMode, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "top_logprobs", "finish_reason", "stop_reason", "usage", "timing", "routing", "prompt_token_ids", "error_message", "tokens", "index", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    routing: RoutingInfo
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    error_message: str
    tokens: _containers.RepeatedScalarFieldContainer[str]
    index: int
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., routing: _Optional[_Union[RoutingInfo, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., error_message: _Optional[str] = ..., tokens: _Optional[_Iterable[str]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class ValidateConfigRequest(_message.Message):
    __slots__ = ("model_path", "shape", "parallel", "block_size", "role")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    shape: _common_pb2.ModelShape
    parallel: _common_pb2.ParallelConfig
    block_size: int
    role: _common_pb2.Role
    def __init__(self, model_path: _Optional[str] = ..., shape: _Optional[_Union[_common_pb2.ModelShape, _Mapping]] = ..., parallel: _Optional[_Union[_common_pb2.ParallelConfig, _Mapping]] = ..., block_size: _Optional[int] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class ConfigFix(_message.Message):
    __slots__ = ("flag", "suggested_value", "text")
    FLAG_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_VALUE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    flag: str
    suggested_value: str
    text: str
    def __init__(self, flag: _Optional[str] = ..., suggested_value: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ValidateConfigResponse(_message.Message):
    __slots__ = ("valid", "message", "fixes", "warnings", "kv_layout")
    VALID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIXES_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    message: str
    fixes: _containers.RepeatedCompositeFieldContainer[ConfigFix]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    kv_layout: _common_pb2.KVLayout
    def __init__(self, valid: _Optional[bool] = ..., message: _Optional[str] = ..., fixes: _Optional[_Iterable[_Union[ConfigFix, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ("role", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    model: str
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., model: _Optional[str] = ...) -> None: ...

class PodStatus(_message.Message):
    __slots__ = ("pod_id", "role", "address", "kv_transfer_address", "model", "parallel", "state", "load", "kv", "last_heartbeat_age_s", "kv_layout", "uptime_s", "num_inflight_requests", "local_prefill_max_tokens")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    role: _common_pb2.Role
    address: str
    kv_transfer_address: str
    model: str
    parallel: _common_pb2.ParallelConfig
    state: _common_pb2.PodState
    load: _common_pb2.LoadStats
    kv: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankKVStats]
    last_heartbeat_age_s: float
    kv_layout: _common_pb2.KVLayout
    uptime_s: float
    num_inflight_requests: int
    local_prefill_max_tokens: int
    def __init__(self, pod_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., model: _Optional[str] = ..., parallel: _Optional[_Union[_common_pb2.ParallelConfig, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.PodState, str]] = ..., load: _Optional[_Union[_common_pb2.LoadStats, _Mapping]] = ..., kv: _Optional[_Iterable[_Union[_common_pb2.RankKVStats, _Mapping]]] = ..., last_heartbeat_age_s: _Optional[float] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., uptime_s: _Optional[float] = ..., num_inflight_requests: _Optional[int] = ..., local_prefill_max_tokens: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("pods", "router_queue_depth", "num_inflight_requests", "ready_models")
    PODS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    READY_MODELS_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[PodStatus]
    router_queue_depth: int
    num_inflight_requests: int
    ready_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pods: _Optional[_Iterable[_Union[PodStatus, _Mapping]]] = ..., router_queue_depth: _Optional[int] = ..., num_inflight_requests: _Optional[int] = ..., ready_models: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
