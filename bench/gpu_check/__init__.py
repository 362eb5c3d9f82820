"""`scripts/gpu-check`: the CUDA path proved in one prepared run (`main.py`)."""
