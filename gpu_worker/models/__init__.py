"""Models: `config` parses a checkpoint's config.json (no torch, so the launcher can check a
model folder before any process starts), `layers` and `llama` are the decoder, `loader`
reads the weights."""
