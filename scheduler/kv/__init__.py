"""The scheduler's KV cache accounting: blocks and their prefix hashes (block_manager,
block_index), the host tier's index (host_tier) and vLLM's KV events (events)."""
