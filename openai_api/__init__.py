"""The OpenAI-compatible HTTP API the frontend serves beside gRPC (`tandem serve --http-port`).

One folder per surface, over what they all share here: `protocol` holds the pydantic request
models of completions and chat completions, `errors` the OpenAI-shaped errors, `models` what
the `model` field may name (the base model or a LoRA adapter), `app` is the FastAPI
application and `server` runs it with uvicorn on the frontend's event loop.

    chat/        /v1/completions and /v1/chat/completions: parameters, chat templates,
                 serving (JSON or SSE), the response shapes and logprobs
    agents/      tools and reasoning: how a chat request's output is read and constrained
    responses/   /v1/responses over the chat pipeline

Torch-free, like the rest of the frontend.
"""
