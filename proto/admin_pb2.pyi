from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileRequest(_message.Message):
    __slots__ = ("duration_s", "plans", "torch_trace_path")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    TORCH_TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    plans: int
    torch_trace_path: str
    def __init__(self, duration_s: _Optional[float] = ..., plans: _Optional[int] = ..., torch_trace_path: _Optional[str] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("profiles_json", "plans_recorded", "torch_trace_path", "torch_trace_error")
    PROFILES_JSON_FIELD_NUMBER: _ClassVar[int]
    PLANS_RECORDED_FIELD_NUMBER: _ClassVar[int]
    TORCH_TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    TORCH_TRACE_ERROR_FIELD_NUMBER: _ClassVar[int]
    profiles_json: bytes
    plans_recorded: int
    torch_trace_path: str
    torch_trace_error: str
    def __init__(self, profiles_json: _Optional[bytes] = ..., plans_recorded: _Optional[int] = ..., torch_trace_path: _Optional[str] = ..., torch_trace_error: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting", "num_preemptions", "prefix_hit_tokens", "prefix_query_tokens", "tokens_delivered", "tokens_after_finish", "uptime_s", "num_plans", "worker_busy_s", "forward_s", "postproc_busy_s", "steady_busy_s", "steady_idle_s", "loaded_adapters", "adapter_loads")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AFTER_FINISH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PLANS_FIELD_NUMBER: _ClassVar[int]
    WORKER_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    POSTPROC_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    STEADY_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    STEADY_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOADS_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    tokens_delivered: int
    tokens_after_finish: int
    uptime_s: float
    num_plans: int
    worker_busy_s: float
    forward_s: float
    postproc_busy_s: float
    steady_busy_s: float
    steady_idle_s: float
    loaded_adapters: _containers.RepeatedScalarFieldContainer[str]
    adapter_loads: int
    def __init__(self, num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., tokens_delivered: _Optional[int] = ..., tokens_after_finish: _Optional[int] = ..., uptime_s: _Optional[float] = ..., num_plans: _Optional[int] = ..., worker_busy_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., postproc_busy_s: _Optional[float] = ..., steady_busy_s: _Optional[float] = ..., steady_idle_s: _Optional[float] = ..., loaded_adapters: _Optional[_Iterable[str]] = ..., adapter_loads: _Optional[int] = ...) -> None: ...
