"""Models: `config` parses a checkpoint's config.json (no torch, so the launcher can check a
model folder before any process starts; family specifics in `config_families`, RoPE in
`config_rope`), `layout` names each family's checkpoint tensors, `layers`, `rope`, `moe` and
`llama` are the decoder, `fill` and `loader` read the weights, `sharding` splits them."""
