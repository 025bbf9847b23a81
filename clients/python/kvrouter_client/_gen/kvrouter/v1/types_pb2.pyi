from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor
STORAGE_TIER_DEVICE: StorageTier
STORAGE_TIER_DISK: StorageTier
STORAGE_TIER_EXTERNAL: StorageTier
STORAGE_TIER_HOST: StorageTier
STORAGE_TIER_UNSPECIFIED: StorageTier
WORKER_ROLE_AGGREGATED: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_UNSPECIFIED: WorkerRole

class TierBlocks(_message.Message):
    __slots__ = ["device", "disk", "external", "host"]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    device: int
    disk: int
    external: int
    host: int
    def __init__(self, device: _Optional[int] = ..., host: _Optional[int] = ..., disk: _Optional[int] = ..., external: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ["active_blocks", "active_prefill_tokens", "active_requests", "kv_used_blocks", "waiting_requests"]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    active_blocks: int
    active_prefill_tokens: int
    active_requests: int
    kv_used_blocks: int
    waiting_requests: int
    def __init__(self, active_blocks: _Optional[int] = ..., active_prefill_tokens: _Optional[int] = ..., active_requests: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., waiting_requests: _Optional[int] = ...) -> None: ...

class WorkerTarget(_message.Message):
    __slots__ = ["dp_rank", "endpoint", "worker_id"]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    endpoint: str
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., endpoint: _Optional[str] = ...) -> None: ...

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class StorageTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
