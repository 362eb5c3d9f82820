"""gpu-check's stages, one module each (`bench.gpu_check.main` runs them in a plan's order)."""
