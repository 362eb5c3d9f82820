"""`tandem bench step`: decode ms/step (`main.py`), with its trace, TP, guided and LoRA parts."""
