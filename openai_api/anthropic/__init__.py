"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat
completions pipeline: protocol.py translates, serving.py answers."""
