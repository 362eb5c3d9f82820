"""The sentence-transformers folder format (embedding models and cross-encoders), read
without torch: what the frontend validates requests against and the gpu worker pools by."""
