"""Every internal message kind, registered with the codec (`proto.codec`): one dataclass per
kind, in one module per channel (request_params, request_messages, plan_messages,
token_messages, guided_messages, control_messages, adapter_messages, monitor_messages,
pooling_messages).

A type's place in `MESSAGE_TYPES` is its number on the wire: new types are appended.
"""
from __future__ import annotations

from tandem_serve.proto.adapter_messages import (
    AdapterFailed,
    AdapterLoad,
)
from tandem_serve.proto.control_messages import (
    ControlDone,
    EngineControl,
    ProcessFailed,
    Ready,
    Shutdown,
    WorkerHung,
)
from tandem_serve.proto.guided_messages import (
    GuidedGrammar,
    GuidedLost,
    GuidedTable,
    GuidedWanted,
)
from tandem_serve.proto.monitor_messages import (
    EngineStats,
    Heartbeat,
    PostprocStats,
    ProfileControl,
    ProfileData,
)
from tandem_serve.proto.plan_messages import (
    ContinueRequest,
    NewRequest,
    PlanEnding,
    StepDone,
    StepPlan,
    WorkerReady,
)
from tandem_serve.proto.pooling_messages import (
    PoolDone,
    PoolOutput,
    PoolPlan,
    PoolRequest,
)
from tandem_serve.proto.request_messages import (
    AbortRequest,
    AddRequest,
    ForgetRequest,
    RegisterRequest,
    RequestFailed,
    RequestRejected,
)
from tandem_serve.proto.request_params import (
    ImageInput,
    OutputOptions,
    SamplingParams,
)
from tandem_serve.proto.token_messages import (
    OutputBatch,
    OutputDelta,
    PlanProcessed,
    PromptDetail,
    StopHit,
    TokenBatch,
)

MESSAGE_TYPES: tuple[type, ...] = (
    SamplingParams,
    OutputOptions,
    AddRequest,
    AbortRequest,
    RequestRejected,
    RequestFailed,
    RegisterRequest,
    ForgetRequest,
    NewRequest,
    ContinueRequest,
    StepPlan,
    TokenBatch,
    PromptDetail,
    StepDone,
    WorkerReady,
    StopHit,
    PlanProcessed,
    OutputDelta,
    OutputBatch,
    Shutdown,
    Ready,
    WorkerHung,  # appended: indices of the types above must not move
    EngineStats,
    ProcessFailed,
    Heartbeat,
    ProfileControl,
    ProfileData,
    PostprocStats,
    PlanEnding,
    GuidedTable,
    GuidedGrammar,
    AdapterLoad,
    AdapterFailed,
    GuidedWanted,
    GuidedLost,
    EngineControl,
    ControlDone,
    ImageInput,
    PoolRequest,
    PoolPlan,
    PoolOutput,
    PoolDone,
)
