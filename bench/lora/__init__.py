"""`tandem bench lora`: serving with LoRA adapters next to the base model (`main.py`)."""
