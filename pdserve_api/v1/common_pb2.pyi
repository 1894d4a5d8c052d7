from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_UNIFIED: _ClassVar[Role]

class PodState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POD_STATE_UNSPECIFIED: _ClassVar[PodState]
    POD_STATE_STARTING: _ClassVar[PodState]
    POD_STATE_READY: _ClassVar[PodState]
    POD_STATE_DRAINING: _ClassVar[PodState]
    POD_STATE_UNHEALTHY: _ClassVar[PodState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_NIXL_PULL: _ClassVar[TransferMode]
    TRANSFER_MODE_TCP: _ClassVar[TransferMode]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_UNIFIED: Role
POD_STATE_UNSPECIFIED: PodState
POD_STATE_STARTING: PodState
POD_STATE_READY: PodState
POD_STATE_DRAINING: PodState
POD_STATE_UNHEALTHY: PodState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_NIXL_PULL: TransferMode
TRANSFER_MODE_TCP: TransferMode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids", "logprobs", "ignore_eos", "top_logprobs", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens", "min_p", "logit_bias", "structured_output", "n", "best_of", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    ignore_eos: bool
    top_logprobs: int
    min_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    skip_special_tokens: bool
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    n: int
    best_of: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., skip_special_tokens: _Optional[bool] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StringList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StringList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StringList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "max_model_len", "use_mla", "kv_lora_rank", "qk_rope_head_dim", "sliding_window", "dtype")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    USE_MLA_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    use_mla: bool
    kv_lora_rank: int
    qk_rope_head_dim: int
    sliding_window: int
    dtype: str
    def __init__(self, architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., use_mla: _Optional[bool] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., sliding_window: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ParallelConfig(_message.Message):
    __slots__ = ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size", "dcp_kv_cache_interleave_size", "data_parallel_size")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_KV_CACHE_INTERLEAVE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    dcp_kv_cache_interleave_size: int
    data_parallel_size: int
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., decode_context_parallel_size: _Optional[int] = ..., dcp_kv_cache_interleave_size: _Optional[int] = ..., data_parallel_size: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "tp_size", "dcp_size", "dcp_kv_cache_interleave_size", "pipeline_parallel_size", "num_blocks", "num_kv_heads_per_rank", "use_mla", "element_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_KV_CACHE_INTERLEAVE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    USE_MLA_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int
    dcp_size: int
    dcp_kv_cache_interleave_size: int
    pipeline_parallel_size: int
    num_blocks: int
    num_kv_heads_per_rank: int
    use_mla: bool
    element_size: int
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., dcp_size: _Optional[int] = ..., dcp_kv_cache_interleave_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_kv_heads_per_rank: _Optional[int] = ..., use_mla: _Optional[bool] = ..., element_size: _Optional[int] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids", "num_tokens")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class LoadStats(_message.Message):
    __slots__ = ("queued_prompt_tokens", "num_running_seqs", "num_waiting_seqs", "num_active_leases", "generation_tokens_per_s", "prompt_tokens_per_s")
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    queued_prompt_tokens: int
    num_running_seqs: int
    num_waiting_seqs: int
    num_active_leases: int
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    def __init__(self, queued_prompt_tokens: _Optional[int] = ..., num_running_seqs: _Optional[int] = ..., num_waiting_seqs: _Optional[int] = ..., num_active_leases: _Optional[int] = ..., generation_tokens_per_s: _Optional[float] = ..., prompt_tokens_per_s: _Optional[float] = ...) -> None: ...

class RankKVStats(_message.Message):
    __slots__ = ("rank", "free_blocks", "total_blocks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    free_blocks: int
    total_blocks: int
    def __init__(self, rank: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class WorkerCapacity(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_concurrent_transfers", "transfer_modes")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODES_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_concurrent_transfers: int
    transfer_modes: _containers.RepeatedScalarFieldContainer[TransferMode]
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_concurrent_transfers: _Optional[int] = ..., transfer_modes: _Optional[_Iterable[_Union[TransferMode, str]]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("lease_id", "prefill_pod_id", "kv_transfer_address", "num_layers", "num_tokens", "expires_at_unix_ms", "ttl_s", "transfer_mode", "layout", "block_tables", "block_checksums")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_POD_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    prefill_pod_id: str
    kv_transfer_address: str
    num_layers: int
    num_tokens: int
    expires_at_unix_ms: int
    ttl_s: float
    transfer_mode: TransferMode
    layout: KVLayout
    block_tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., prefill_pod_id: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_tokens: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., ttl_s: _Optional[float] = ..., transfer_mode: _Optional[_Union[TransferMode, str]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("ttft_s", "e2e_s", "queue_s", "prefill_s", "kv_transfer_s", "decode_s", "mean_tpot_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    e2e_s: float
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    decode_s: float
    mean_tpot_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., mean_tpot_s: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "finished", "finish_reason")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs
    finished: bool
    finish_reason: FinishReason
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_logprobs", "token_ids", "tokens")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...
