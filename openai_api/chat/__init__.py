"""`/v1/completions` and `/v1/chat/completions`.

`params` maps the request models (`openai_api.protocol`) onto the engine's `SamplingParams` /
`OutputOptions` through `frontend.validation`'s limits, `chat_template` renders a
checkpoint's chat template the way transformers does, `serving` runs both endpoints (JSON or
server-sent events) on `frontend.frontend.Frontend`, `shapes` turns the engine's deltas into
their two JSON shapes and `logprobs` names tokens by their text in OpenAI's logprobs shapes.
The Responses API (`openai_api/responses/`) runs over the same `serving`.
"""
