"""LoRA adapters in the PEFT layout, read without torch.

`peft` resolves an `adapter_id` to its folder under the adapter cache, parses
`adapter_config.json` and the safetensors header of `adapter_model.safetensors`, and checks
both against the served model's linear layers: the frontend validates requests with it, and
the gpu worker plans where each tensor goes in its adapter slots from the same answer.
"""
