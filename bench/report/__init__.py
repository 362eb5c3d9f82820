"""`tandem bench report`: rerun the benchmarks, rewrite docs/BENCHMARKS.md (`main.py`)."""
