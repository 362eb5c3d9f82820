"""Quantized checkpoints: `config` parses and checks config.json's `quantization_config`
(torch-free, so the launcher refuses a format before any process starts), `split` says
which tensor-parallel sizes keep groups and blocks whole (torch-free), `tensors` names each
format's checkpoint tensors and the part a rank reads, `formats` unpacks them into one of
two in-memory forms (`Fp8Weight`, `Int4Weight`), `linear` runs them (torch's FP8 and int4
kernels on CUDA, dequantize-then-matmul elsewhere), `load` is the loader's glue."""
