"""The pooling runner (`--runner pooling`): encoders, decoder embedding models and
cross-encoders, prefill only, vectors out (docs/DESIGN.md section 24)."""
