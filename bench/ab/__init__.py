"""`tandem bench ab`: the sync/async x K table (`main.py`), its peers and its tables."""
