"""The frontend process, and what its two APIs (`rpc/` gRPC, `openai_api/` HTTP) share.

`validation` says what a valid request is under which `Limits`, `frontend` tokenizes,
compiles (`guided`) and submits it through the `engine_client` (per-request
`stream_buffer`s) and holds readiness and the drain state, `adapter_store` validates LoRA
adapter ids, `metrics` is the Prometheus endpoint, `ports` checks and binds the process's
ports, and `standalone` keeps a set of roles serving when they run on their own.  `main`
assembles the process (both APIs on one event loop, readiness, drain, failure): the one
module here that imports `rpc/` and `openai_api/`.
"""
