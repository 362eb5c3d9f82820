"""`POST /v1/responses`: OpenAI's Responses API (text) over the chat pipeline.

`protocol` holds the request model, the chat request it becomes and the output items its
message becomes; `serving` answers with one JSON object or OpenAI's event stream.
"""
