"""What the frontend's two APIs (`rpc/` gRPC, `openai_api/` HTTP) share.

`validation` says what a valid request is under which `Limits`, `frontend` tokenizes,
compiles (`guided`) and submits it through the `engine_client` (per-request
`stream_buffer`s) and holds readiness and the drain state, `adapter_store` validates LoRA
adapter ids, and `metrics` is the Prometheus endpoint.
"""
