"""Image input for vision-language checkpoints: which ones, their vision tower and M-RoPE
positions (design guide section 23)."""
