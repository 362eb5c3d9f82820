"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5): Gated DeltaNet layers beside gated
full attention, and the per-request recurrent-state cache they need."""
