"""`tandem bench postproc`: postprocessing tokens/s next to decode tokens/s (`main.py`)."""
