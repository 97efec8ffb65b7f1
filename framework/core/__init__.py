"""The engine core: requests, KV-cache blocks and the scheduler."""
