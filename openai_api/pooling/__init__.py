"""Embeddings, rerank and score over HTTP (`--runner pooling`)."""
