from kvrouter_client._gen.kvrouter.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Ack(_message.Message):
    __slots__ = ["event_id"]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    def __init__(self, event_id: _Optional[int] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ["block_hashes"]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ["blocks", "cache_namespace", "lora_name", "parent_hash"]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    cache_namespace: str
    lora_name: str
    parent_hash: int
    def __init__(self, parent_hash: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ..., lora_name: _Optional[str] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class CacheCleared(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ["events"]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class KvDump(_message.Message):
    __slots__ = ["events", "more_follows", "through_event_id"]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    THROUGH_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    more_follows: bool
    through_event_id: int
    def __init__(self, through_event_id: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., more_follows: bool = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ["cleared", "dp_rank", "event_id", "removed", "storage_tier", "stored"]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    STORAGE_TIER_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    cleared: CacheCleared
    dp_rank: int
    event_id: int
    removed: BlocksRemoved
    storage_tier: _types_pb2.StorageTier
    stored: BlocksStored
    def __init__(self, event_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., storage_tier: _Optional[_Union[_types_pb2.StorageTier, str]] = ..., stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[CacheCleared, _Mapping]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ["dp_rank", "kv_used_blocks", "waiting_requests"]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    kv_used_blocks: int
    waiting_requests: int
    def __init__(self, dp_rank: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., waiting_requests: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ["dump", "events", "hello", "leave", "load"]
    DUMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    dump: KvDump
    events: EventBatch
    hello: WorkerHello
    leave: WorkerLeave
    load: LoadReport
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., dump: _Optional[_Union[KvDump, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., leave: _Optional[_Union[WorkerLeave, _Mapping]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ["ack", "registered", "resync"]
    ACK_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    registered: Registered
    resync: ResyncRequest
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., resync: _Optional[_Union[ResyncRequest, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ["last_event_id"]
    LAST_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    last_event_id: int
    def __init__(self, last_event_id: _Optional[int] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ["expected_event_id", "reason"]
    EXPECTED_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    expected_event_id: int
    reason: str
    def __init__(self, reason: _Optional[str] = ..., expected_event_id: _Optional[int] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ["block_hash", "mm_hashes", "token_ids", "tokens_hash"]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    MM_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    mm_hashes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens_hash: int
    def __init__(self, block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., tokens_hash: _Optional[int] = ..., mm_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ["block_size", "dp_rank", "endpoint", "fresh_start", "kv_events_enabled", "max_num_batched_tokens", "model", "no_endpoint", "role", "supports_bypass", "total_kv_blocks", "worker_id"]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FRESH_START_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NO_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_BYPASS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    dp_rank: int
    endpoint: str
    fresh_start: bool
    kv_events_enabled: bool
    max_num_batched_tokens: int
    model: str
    no_endpoint: bool
    role: _types_pb2.WorkerRole
    supports_bypass: bool
    total_kv_blocks: int
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., model: _Optional[str] = ..., role: _Optional[_Union[_types_pb2.WorkerRole, str]] = ..., block_size: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., endpoint: _Optional[str] = ..., supports_bypass: bool = ..., kv_events_enabled: bool = ..., fresh_start: bool = ..., no_endpoint: bool = ...) -> None: ...

class WorkerLeave(_message.Message):
    __slots__ = ["reason"]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...
