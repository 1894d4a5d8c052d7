from pdserve_api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentInfo(_message.Message):
    __slots__ = ("rank", "agent_name", "agent_metadata", "serialized_descs", "region_base_addr", "region_size_bytes", "device_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    SERIALIZED_DESCS_FIELD_NUMBER: _ClassVar[int]
    REGION_BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    REGION_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    agent_name: str
    agent_metadata: bytes
    serialized_descs: bytes
    region_base_addr: int
    region_size_bytes: int
    device_id: int
    def __init__(self, rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., serialized_descs: _Optional[bytes] = ..., region_base_addr: _Optional[int] = ..., region_size_bytes: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("peer_pod_id", "peer_agent_name", "peer_agents", "peer_layout", "cluster_token")
    PEER_POD_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_AGENTS_FIELD_NUMBER: _ClassVar[int]
    PEER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    peer_pod_id: str
    peer_agent_name: str
    peer_agents: _containers.RepeatedCompositeFieldContainer[AgentInfo]
    peer_layout: _common_pb2.KVLayout
    cluster_token: str
    def __init__(self, peer_pod_id: _Optional[str] = ..., peer_agent_name: _Optional[str] = ..., peer_agents: _Optional[_Iterable[_Union[AgentInfo, _Mapping]]] = ..., peer_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., cluster_token: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("pod_id", "agent_name", "agents", "layout", "transfer_modes")
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODES_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    agent_name: str
    agents: _containers.RepeatedCompositeFieldContainer[AgentInfo]
    layout: _common_pb2.KVLayout
    transfer_modes: _containers.RepeatedScalarFieldContainer[_common_pb2.TransferMode]
    def __init__(self, pod_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[AgentInfo, _Mapping]]] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., transfer_modes: _Optional[_Iterable[_Union[_common_pb2.TransferMode, str]]] = ...) -> None: ...

class WatchLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class LayerProgress(_message.Message):
    __slots__ = ("layers_done", "total_layers", "state", "message")
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    layers_done: int
    total_layers: int
    state: _common_pb2.LeaseState
    message: str
    def __init__(self, layers_done: _Optional[int] = ..., total_layers: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.LeaseState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class KVSegment(_message.Message):
    __slots__ = ("src_rank", "src_offset", "length")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    src_offset: int
    length: int
    def __init__(self, src_rank: _Optional[int] = ..., src_offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReadKVRequest(_message.Message):
    __slots__ = ("lease_id", "dst_rank", "segments", "max_chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    dst_rank: int
    segments: _containers.RepeatedCompositeFieldContainer[KVSegment]
    max_chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., dst_rank: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[KVSegment, _Mapping]]] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CompleteTransferRequest(_message.Message):
    __slots__ = ("lease_id", "decode_rank")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_RANK_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    decode_rank: int
    def __init__(self, lease_id: _Optional[str] = ..., decode_rank: _Optional[int] = ...) -> None: ...

class CompleteTransferResponse(_message.Message):
    __slots__ = ("lease_completed", "ranks_remaining")
    LEASE_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    RANKS_REMAINING_FIELD_NUMBER: _ClassVar[int]
    lease_completed: bool
    ranks_remaining: int
    def __init__(self, lease_completed: _Optional[bool] = ..., ranks_remaining: _Optional[int] = ...) -> None: ...
