"""`tandem bench guided`: guided requests served, per kind, next to none (`main.py`)."""
