"""Image input for vision-language models: fetching and decoding URLs (fetch), the
checkpoint's own processor and placeholder expansion (images)."""
