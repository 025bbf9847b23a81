from kvrouter_client._gen.kvrouter.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

CONFIG_SOURCE_DEFAULT: ConfigSource
CONFIG_SOURCE_ENV: ConfigSource
CONFIG_SOURCE_FILE: ConfigSource
CONFIG_SOURCE_FLAG: ConfigSource
CONFIG_SOURCE_UNSPECIFIED: ConfigSource
DESCRIPTOR: _descriptor.FileDescriptor

class ConfigEntry(_message.Message):
    __slots__ = ["key", "source", "value"]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    source: ConfigSource
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ..., source: _Optional[_Union[ConfigSource, str]] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ["entries"]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ConfigEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[ConfigEntry, _Mapping]]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ["bookings", "digest", "index_blocks", "log", "log_generation", "log_last_id", "log_position", "pending_changes", "shards", "shared_state_complete", "workers"]
    BOOKINGS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    LOG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOG_LAST_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_POSITION_FIELD_NUMBER: _ClassVar[int]
    PENDING_CHANGES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_STATE_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    bookings: int
    digest: str
    index_blocks: int
    log: str
    log_generation: str
    log_last_id: str
    log_position: int
    pending_changes: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardState]
    shared_state_complete: bool
    workers: int
    def __init__(self, log: _Optional[str] = ..., log_position: _Optional[int] = ..., log_last_id: _Optional[str] = ..., pending_changes: _Optional[int] = ..., digest: _Optional[str] = ..., workers: _Optional[int] = ..., index_blocks: _Optional[int] = ..., bookings: _Optional[int] = ..., log_generation: _Optional[str] = ..., shared_state_complete: bool = ..., shards: _Optional[_Iterable[_Union[ShardState, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ["model"]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ["workers"]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class ShardState(_message.Message):
    __slots__ = ["bookings", "digest", "index_blocks", "log_generation", "log_last_id", "log_position", "model", "pending_changes", "shared_state_complete", "workers"]
    BOOKINGS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOG_LAST_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_POSITION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PENDING_CHANGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_STATE_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    bookings: int
    digest: str
    index_blocks: int
    log_generation: str
    log_last_id: str
    log_position: int
    model: str
    pending_changes: int
    shared_state_complete: bool
    workers: int
    def __init__(self, model: _Optional[str] = ..., log_position: _Optional[int] = ..., log_last_id: _Optional[str] = ..., log_generation: _Optional[str] = ..., pending_changes: _Optional[int] = ..., digest: _Optional[str] = ..., workers: _Optional[int] = ..., index_blocks: _Optional[int] = ..., bookings: _Optional[int] = ..., shared_state_complete: bool = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ["awaiting_resync", "block_size", "cached_blocks", "connected", "kv_events_enabled", "last_event_id", "load", "max_num_batched_tokens", "model", "role", "supports_bypass", "total_kv_blocks", "worker"]
    AWAITING_RESYNC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_BYPASS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    awaiting_resync: bool
    block_size: int
    cached_blocks: _types_pb2.TierBlocks
    connected: bool
    kv_events_enabled: bool
    last_event_id: int
    load: _types_pb2.WorkerLoad
    max_num_batched_tokens: int
    model: str
    role: _types_pb2.WorkerRole
    supports_bypass: bool
    total_kv_blocks: int
    worker: _types_pb2.WorkerTarget
    def __init__(self, worker: _Optional[_Union[_types_pb2.WorkerTarget, _Mapping]] = ..., model: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.WorkerRole, str]] = ..., block_size: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., supports_bypass: bool = ..., kv_events_enabled: bool = ..., connected: bool = ..., last_event_id: _Optional[int] = ..., cached_blocks: _Optional[_Union[_types_pb2.TierBlocks, _Mapping]] = ..., load: _Optional[_Union[_types_pb2.WorkerLoad, _Mapping]] = ..., awaiting_resync: bool = ...) -> None: ...

class ConfigSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
