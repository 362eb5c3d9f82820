"""The OpenAI-compatible HTTP API the frontend serves beside gRPC (`tandem serve --http-port`).

`protocol` holds the pydantic request models, `params` maps them onto the engine's
`SamplingParams` / `OutputOptions` through `frontend.validation`'s limits, `chat_template`
renders a checkpoint's chat template the way transformers does, `serving` runs completions
and chat completions (JSON or server-sent events) on `frontend.frontend.Frontend`, `app` is the
FastAPI application and `server` runs it with uvicorn on the frontend's event loop.

Agents: `tools` plans a request's `tools` / `tool_choice`, `tool_parsers/` reads calls out of
model text (hermes, llama3_json, mistral, and the JSON of guided choices), `reasoning` splits
`<think>` text off the content and fits a constraint after it, `message` turns a choice's
text into reasoning, content and calls (streamed or whole), `agents` ties them into a chat
request, and `responses` / `responses_stream` serve `/v1/responses` over the chat pipeline.
Torch-free, like the rest of the frontend.
"""
