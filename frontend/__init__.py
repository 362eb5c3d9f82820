"""What the frontend process's two APIs (`rpc/` gRPC, `openai_api/` HTTP) share.

`validation` says what a valid request is under which `Limits`, `frontend` tokenizes,
compiles (`guided`) and submits it through the `engine_client` (per-request
`stream_buffer`s) and holds readiness and the drain state, `adapter_store` validates LoRA
adapter ids, `metrics` is the Prometheus endpoint, `ports` checks and binds the process's
ports, and `standalone` keeps a set of roles serving when they run on their own.  Neither
API is imported here: the process that serves both (one event loop, readiness, drain,
failure) is assembled above them, in `tandem/serve.py`.
"""
