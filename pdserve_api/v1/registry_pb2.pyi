from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("pod_id", "role", "address", "kv_transfer_address", "model", "model_shape", "parallel", "kv_layout", "capacity", "cluster_token", "version", "state", "kv", "step_profile")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    STEP_PROFILE_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    role: _common_pb2.Role
    address: str
    kv_transfer_address: str
    model: str
    model_shape: _common_pb2.ModelShape
    parallel: _common_pb2.ParallelConfig
    kv_layout: _common_pb2.KVLayout
    capacity: _common_pb2.WorkerCapacity
    cluster_token: str
    version: str
    state: _common_pb2.PodState
    kv: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankKVStats]
    step_profile: StepProfile
    def __init__(self, pod_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., model: _Optional[str] = ..., model_shape: _Optional[_Union[_common_pb2.ModelShape, _Mapping]] = ..., parallel: _Optional[_Union[_common_pb2.ParallelConfig, _Mapping]] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., capacity: _Optional[_Union[_common_pb2.WorkerCapacity, _Mapping]] = ..., cluster_token: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.PodState, str]] = ..., kv: _Optional[_Iterable[_Union[_common_pb2.RankKVStats, _Mapping]]] = ..., step_profile: _Optional[_Union[StepProfile, _Mapping]] = ...) -> None: ...

class StepProfile(_message.Message):
    __slots__ = ("prefill_tokens", "prefill_s", "decode_step_s")
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    prefill_s: _containers.RepeatedScalarFieldContainer[float]
    decode_step_s: float
    def __init__(self, prefill_tokens: _Optional[_Iterable[int]] = ..., prefill_s: _Optional[_Iterable[float]] = ..., decode_step_s: _Optional[float] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("accepted", "message", "heartbeat_interval_s", "router_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    heartbeat_interval_s: float
    router_id: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., router_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("pod_id", "load", "kv", "state", "cluster_token")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    load: _common_pb2.LoadStats
    kv: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankKVStats]
    state: _common_pb2.PodState
    cluster_token: str
    def __init__(self, pod_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.LoadStats, _Mapping]] = ..., kv: _Optional[_Iterable[_Union[_common_pb2.RankKVStats, _Mapping]]] = ..., state: _Optional[_Union[_common_pb2.PodState, str]] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "desired_state", "heartbeat_interval_s")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DESIRED_STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    known: bool
    desired_state: _common_pb2.PodState
    heartbeat_interval_s: float
    def __init__(self, known: _Optional[bool] = ..., desired_state: _Optional[_Union[_common_pb2.PodState, str]] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("pod_id", "cluster_token")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    cluster_token: str
    def __init__(self, pod_id: _Optional[str] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
