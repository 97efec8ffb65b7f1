"""Workers: own a device, the model and its KV cache."""
