"""`tandem bench soak`: RSS of every process under a steady load (`main.py`)."""
