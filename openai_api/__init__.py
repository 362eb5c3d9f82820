"""The OpenAI-compatible HTTP API the frontend serves beside gRPC (`tandem serve --http-port`).

`protocol` holds the pydantic request models, `params` maps them onto the engine's
`SamplingParams` / `OutputOptions` through `frontend.validation`'s limits, `chat_template`
renders a checkpoint's chat template the way transformers does, `serving` runs completions
and chat completions (JSON or server-sent events) on `frontend.frontend.Frontend`, `app` is the
FastAPI application and `server` runs it with uvicorn on the frontend's event loop.
Torch-free, like the rest of the frontend.
"""
