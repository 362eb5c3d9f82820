"""`tandem bench spec`: speculative decoding against none (`main.py`), on the copier model
(`copier.py`) with copy-heavy and plain prompts (`workload.py`); its tables (`report.py`)."""
