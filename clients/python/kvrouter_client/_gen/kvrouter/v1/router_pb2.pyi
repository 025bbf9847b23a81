from kvrouter_client._gen.kvrouter.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

BUSY_SIGNAL_BUSY: BusySignal
BUSY_SIGNAL_NOT_BUSY: BusySignal
BUSY_SIGNAL_UNKNOWN: BusySignal
BUSY_SIGNAL_UNSPECIFIED: BusySignal
DECISION_REASON_BYPASS: DecisionReason
DECISION_REASON_CONDITIONAL_DISAGG_OFF: DecisionReason
DECISION_REASON_DECODE_AFFINITY_UNRESOLVED: DecisionReason
DECISION_REASON_DECODE_BUSY: DecisionReason
DECISION_REASON_DECODE_BUSY_UNKNOWN: DecisionReason
DECISION_REASON_DECODE_CANNOT_BYPASS: DecisionReason
DECISION_REASON_DECODE_PIN_UNRESOLVED: DecisionReason
DECISION_REASON_DECODE_SELECTION_FAILED: DecisionReason
DECISION_REASON_EMPTY_PROMPT: DecisionReason
DECISION_REASON_NO_PREFILL_WORKERS: DecisionReason
DECISION_REASON_POLICY_DECLINED: DecisionReason
DECISION_REASON_PREFILL_WORKER_PINNED: DecisionReason
DECISION_REASON_UNSPECIFIED: DecisionReason
DESCRIPTOR: _descriptor.FileDescriptor
ROUTE_MODE_AGGREGATED: RouteMode
ROUTE_MODE_BYPASS: RouteMode
ROUTE_MODE_DISAGGREGATED: RouteMode
ROUTE_MODE_UNSPECIFIED: RouteMode

class CandidateCost(_message.Message):
    __slots__ = ["chosen", "cost", "hop", "load", "overlap_blocks", "potential_decode_blocks", "role", "worker"]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POTENTIAL_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    chosen: bool
    cost: float
    hop: str
    load: _types_pb2.WorkerLoad
    overlap_blocks: _types_pb2.TierBlocks
    potential_decode_blocks: int
    role: _types_pb2.WorkerRole
    worker: _types_pb2.WorkerTarget
    def __init__(self, worker: _Optional[_Union[_types_pb2.WorkerTarget, _Mapping]] = ..., role: _Optional[_Union[_types_pb2.WorkerRole, str]] = ..., hop: _Optional[str] = ..., overlap_blocks: _Optional[_Union[_types_pb2.TierBlocks, _Mapping]] = ..., cost: _Optional[float] = ..., chosen: bool = ..., load: _Optional[_Union[_types_pb2.WorkerLoad, _Mapping]] = ..., potential_decode_blocks: _Optional[int] = ...) -> None: ...

class ConditionalDisaggDiagnostics(_message.Message):
    __slots__ = ["cached_tokens", "decode", "decode_busy", "eff_isl_ratio_threshold", "eff_isl_threshold", "effective_isl", "gate_decision", "policy", "policy_says_bypass", "potential_decode_blocks", "prefill_busy", "ratio"]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_BUSY_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_ISL_FIELD_NUMBER: _ClassVar[int]
    EFF_ISL_RATIO_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EFF_ISL_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    GATE_DECISION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_SAYS_BYPASS_FIELD_NUMBER: _ClassVar[int]
    POTENTIAL_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: float
    decode: _types_pb2.WorkerTarget
    decode_busy: BusySignal
    eff_isl_ratio_threshold: float
    eff_isl_threshold: int
    effective_isl: float
    gate_decision: str
    policy: str
    policy_says_bypass: bool
    potential_decode_blocks: int
    prefill_busy: BusySignal
    ratio: float
    def __init__(self, policy: _Optional[str] = ..., decode: _Optional[_Union[_types_pb2.WorkerTarget, _Mapping]] = ..., cached_tokens: _Optional[float] = ..., effective_isl: _Optional[float] = ..., ratio: _Optional[float] = ..., prefill_busy: _Optional[_Union[BusySignal, str]] = ..., decode_busy: _Optional[_Union[BusySignal, str]] = ..., policy_says_bypass: bool = ..., gate_decision: _Optional[str] = ..., potential_decode_blocks: _Optional[int] = ..., eff_isl_threshold: _Optional[int] = ..., eff_isl_ratio_threshold: _Optional[float] = ...) -> None: ...

class ConditionalDisaggOverride(_message.Message):
    __slots__ = ["decode_busy_threshold", "eff_isl_ratio_threshold", "eff_isl_threshold", "enabled", "policy", "prefill_busy_threshold"]
    DECODE_BUSY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EFF_ISL_RATIO_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EFF_ISL_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    decode_busy_threshold: float
    eff_isl_ratio_threshold: float
    eff_isl_threshold: int
    enabled: bool
    policy: str
    prefill_busy_threshold: float
    def __init__(self, enabled: bool = ..., policy: _Optional[str] = ..., eff_isl_threshold: _Optional[int] = ..., eff_isl_ratio_threshold: _Optional[float] = ..., prefill_busy_threshold: _Optional[float] = ..., decode_busy_threshold: _Optional[float] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ["request_id"]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class HopDiagnostics(_message.Message):
    __slots__ = ["cached_tokens", "cost", "overlap_blocks"]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: float
    cost: float
    overlap_blocks: _types_pb2.TierBlocks
    def __init__(self, overlap_blocks: _Optional[_Union[_types_pb2.TierBlocks, _Mapping]] = ..., cached_tokens: _Optional[float] = ..., cost: _Optional[float] = ...) -> None: ...

class MarkPrefillCompleteRequest(_message.Message):
    __slots__ = ["request_id"]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class MarkPrefillCompleteResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class MultimodalObject(_message.Message):
    __slots__ = ["end", "mm_hash", "start"]
    END_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    end: int
    mm_hash: int
    start: int
    def __init__(self, mm_hash: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class RouteDiagnostics(_message.Message):
    __slots__ = ["block_size", "candidates", "conditional_disagg", "decode", "prefill", "prompt_blocks", "prompt_tokens", "reason"]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CONDITIONAL_DISAGG_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateCost]
    conditional_disagg: ConditionalDisaggDiagnostics
    decode: HopDiagnostics
    prefill: HopDiagnostics
    prompt_blocks: int
    prompt_tokens: int
    reason: DecisionReason
    def __init__(self, prompt_tokens: _Optional[int] = ..., prompt_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., prefill: _Optional[_Union[HopDiagnostics, _Mapping]] = ..., decode: _Optional[_Union[HopDiagnostics, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[CandidateCost, _Mapping]]] = ..., reason: _Optional[_Union[DecisionReason, str]] = ..., conditional_disagg: _Optional[_Union[ConditionalDisaggDiagnostics, _Mapping]] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ["annotations", "block_hashes", "block_size", "cache_namespace", "config_override", "explain", "hints", "lora_name", "model", "multimodal_objects", "prompt_tokens", "query_only", "request_id", "session_id", "token_ids"]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUERY_ONLY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.RepeatedScalarFieldContainer[str]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    cache_namespace: str
    config_override: RouterConfigOverride
    explain: bool
    hints: RoutingHints
    lora_name: str
    model: str
    multimodal_objects: _containers.RepeatedCompositeFieldContainer[MultimodalObject]
    prompt_tokens: int
    query_only: bool
    request_id: str
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., cache_namespace: _Optional[str] = ..., query_only: bool = ..., annotations: _Optional[_Iterable[str]] = ..., hints: _Optional[_Union[RoutingHints, _Mapping]] = ..., config_override: _Optional[_Union[RouterConfigOverride, _Mapping]] = ..., explain: bool = ..., session_id: _Optional[str] = ..., multimodal_objects: _Optional[_Iterable[_Union[MultimodalObject, _Mapping]]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ["annotations", "booked", "decode", "diagnostics", "mode", "prefill"]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    BOOKED_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.RepeatedScalarFieldContainer[str]
    booked: bool
    decode: _types_pb2.WorkerTarget
    diagnostics: RouteDiagnostics
    mode: RouteMode
    prefill: _types_pb2.WorkerTarget
    def __init__(self, mode: _Optional[_Union[RouteMode, str]] = ..., prefill: _Optional[_Union[_types_pb2.WorkerTarget, _Mapping]] = ..., decode: _Optional[_Union[_types_pb2.WorkerTarget, _Mapping]] = ..., annotations: _Optional[_Iterable[str]] = ..., booked: bool = ..., diagnostics: _Optional[_Union[RouteDiagnostics, _Mapping]] = ...) -> None: ...

class RouterConfigOverride(_message.Message):
    __slots__ = ["assume_kv_reuse", "conditional_disagg", "overlap_score_credit", "overlap_score_weight", "prefill_load_scale", "router_temperature", "shared_cache_multiplier", "track_prefill_tokens"]
    ASSUME_KV_REUSE_FIELD_NUMBER: _ClassVar[int]
    CONDITIONAL_DISAGG_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SCORE_CREDIT_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SCORE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SHARED_CACHE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    TRACK_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    assume_kv_reuse: bool
    conditional_disagg: ConditionalDisaggOverride
    overlap_score_credit: float
    overlap_score_weight: float
    prefill_load_scale: float
    router_temperature: float
    shared_cache_multiplier: float
    track_prefill_tokens: bool
    def __init__(self, overlap_score_credit: _Optional[float] = ..., prefill_load_scale: _Optional[float] = ..., overlap_score_weight: _Optional[float] = ..., router_temperature: _Optional[float] = ..., assume_kv_reuse: bool = ..., track_prefill_tokens: bool = ..., shared_cache_multiplier: _Optional[float] = ..., conditional_disagg: _Optional[_Union[ConditionalDisaggOverride, _Mapping]] = ...) -> None: ...

class RoutingHints(_message.Message):
    __slots__ = ["allowed_worker_ids", "decode_dp_rank", "decode_worker_id", "prefill_dp_rank", "prefill_worker_id"]
    ALLOWED_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    allowed_worker_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_dp_rank: int
    decode_worker_id: int
    prefill_dp_rank: int
    prefill_worker_id: int
    def __init__(self, prefill_worker_id: _Optional[int] = ..., prefill_dp_rank: _Optional[int] = ..., decode_worker_id: _Optional[int] = ..., decode_dp_rank: _Optional[int] = ..., allowed_worker_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RouteMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class DecisionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class BusySignal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
